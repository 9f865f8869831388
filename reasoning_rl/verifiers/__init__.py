"""Pure scoring: math answers, countdown / reasoning-gym logic, code tests, format, length, rewards.

What keeps a verifier from hanging lives here too: the code sandbox in the `sandbox` subpackage,
killable deadline helpers in `deadline` and the request loop of a verifier process in
`request_loop` (which `reasoning_rl.workers`' pool runs as well). The Scorer and the verifier pool
live in `reasoning_rl.workers`, which builds on this package and not the reverse; the red team of
a reward, which scores through a Scorer, is `reasoning_rl.reward_redteam`. The math verifier
(`math_answers.is_correct`) and the code tests (`code_tests.run_tests`) are named so that no file
here shadows a standard-library module; `import reasoning_rl.verifiers` stays cheap: math-verify
and sympy load only with `math_judge`, in the math verifier's deadline helpers.
"""
