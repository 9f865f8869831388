"""Process machinery: the Scorer interface over inline scoring or a verifier pool."""
