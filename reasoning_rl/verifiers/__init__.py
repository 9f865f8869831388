"""Pure scoring: math answers, countdown / reasoning-gym logic, code tests, format, length, rewards.

The code sandbox lives in the `sandbox` subpackage; worker processes and deadlines live in
`reasoning_rl.workers`. The math verifier (`math_answers.is_correct`) and the code tests
(`code_tests.run_tests`) are named so that no file here shadows a standard-library module;
`import reasoning_rl.verifiers` stays cheap: math-verify and sympy load only with `math_answers`.
"""
