"""The two sizes each algorithm recipe in configs/ comes in (not a config file itself).

- `configs/RECIPE.py`: the CPU demo's model and task (SmolLM2-135M-Instruct on 2-term arithmetic,
  configs/smollm2_arithmetic.py): a run that learns in well under an hour on a laptop.
- `configs/RECIPE.py:debug`: configs/debug_cpu.py's tiny random model on single-digit sums: the
  same algorithm settings in seconds (the tests run it).

Copy a recipe and change its `base` for your own model and task; the algorithm lines stay.
"""

from reasoning_rl.errors import ConfigError

VARIANTS = ("", "debug")


def base(recipe: str, variant: str):
  """The config a recipe starts from (`variant` as given after the file name's colon)."""
  if variant == "debug":
    from configs import debug_cpu  # pylint: disable=import-outside-toplevel

    return debug_cpu.get_config()
  if variant == "":
    from configs import smollm2_arithmetic  # pylint: disable=import-outside-toplevel

    return smollm2_arithmetic.get_config()
  raise ConfigError(f"--config=configs/{recipe}.py:{variant}: unknown variant; use "
                    f"configs/{recipe}.py (the CPU demo) or configs/{recipe}.py:debug (a tiny "
                    "random model, seconds)")
