"""LLM judge vs math-verify's regression verdicts: rule-based alone, rule-based + judge fallback,
judge alone.

Scores the 254 cases of tests/data/math_verify_0.9.0_cases.json (gold, pred, expected 0/1) as
`<answer>pred</answer>` against `gold` through the `judge` reward part
(`reasoning_rl.verifiers.judge.JudgePart`) and reports, per variant, agreement with `expected`,
judge calls, wall seconds and seconds per judged item. The judge is SmolLM2-135M-Instruct (the
GGUF `configs/smollm2_arithmetic.py` trains) decoding greedily on our `Engine`; the cases carry no
question, so the judge sees "(not given)" there.

  python -m benchmarks.judge_agreement [--model PATH] [--template yes_no|score] [--limit N]
  python -m benchmarks.judge_agreement --demo_steps 3

`--demo_steps N` measures the cost per training step instead: it samples N steps of the CPU demo
(`configs/smollm2_arithmetic.py`: 4 prompts x 8 samples, 64 new tokens, its sampling settings) from
SmolLM2 with our engine, and judges each step's 32 completions in one batch (as
`ModelPartsScorer` does) in fallback and alone mode (extract="final_answer", the demo's), each
step with an empty cache; it reports the rule statuses, judge calls and judge seconds per step.

Variants:
  rule:             math_answers.check alone (what the `correct` part pays).
  fallback:         the judge part, mode="fallback", default fallback_statuses (no_answer,
                    unparseable, unevaluated, timeout: the rule verifier could not read the answer).
  fallback+wrong:   fallback_statuses also "wrong" (the judge may overturn any non-correct verdict
                    but the deliberate refusals hedged / multiple_answers / too_large).
  alone:            mode="alone": the judge decides every case with an answer.
Each judge variant starts with an empty cache; the model and its engine are shared. Every variant
runs twice: the first (cold) pass compiles the engine's prefill / decode shapes, the table shows
the second (warm) pass.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
CASES = REPO / "tests" / "data" / "math_verify_0.9.0_cases.json"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default=None, help="judge model (default: the SmolLM2 GGUF)")
  parser.add_argument("--template", default="yes_no", choices=("yes_no", "score"))
  parser.add_argument("--limit", type=int, default=0, help="first N cases only (0: all)")
  parser.add_argument("--json", default="", help="also write the rows here")
  parser.add_argument("--show", type=int, default=0, help="print the judge's replies to N cases")
  parser.add_argument("--demo_steps", type=int, default=0, help="measure the cost per step of "
                      "the CPU demo over N steps instead (module docstring)")
  args = parser.parse_args()
  if args.demo_steps:
    demo_steps(args)
    return

  import importlib

  from reasoning_rl.verifiers import judge as judge_lib
  from reasoning_rl.verifiers.math_answers import check
  from reasoning_rl.verifiers.rewards import CompletionRecord, build_parts

  model = args.model or importlib.import_module("configs.smollm2_arithmetic").smollm2_path()
  cases = json.loads(CASES.read_text())["cases"]
  if args.limit:
    cases = cases[:args.limit]
  records = [CompletionRecord(response=f"<answer>{c['pred']}</answer>", ground_truth=c["gold"])
             for c in cases]
  expected = [c["expected"] for c in cases]
  rows = []

  start = time.perf_counter()
  rule = [float(check(r.response, r.ground_truth).correct) for r in records]
  rows.append(dict(variant="rule", values=rule, calls=0, seconds=time.perf_counter() - start,
                   unparseable=0))

  start = time.perf_counter()
  base = {"weight": 1.0, "model": model, "template": args.template}
  load_settings = build_parts({"judge": base})[0].settings
  generate = judge_lib.EngineJudge.load(load_settings)
  load_s = time.perf_counter() - start
  variants = {
      "fallback": {"mode": "fallback"},
      "fallback+wrong": {"mode": "fallback", "fallback_statuses": (
          "no_answer", "wrong", "unparseable", "unevaluated", "timeout")},
      "alone": {"mode": "alone"},
  }
  cold = {}
  for attempt in ("cold", "warm"):  # cold compiles the engine's shapes; the table shows warm
    for name, extra in variants.items():
      settings = build_parts({"judge": {**base, **extra}})[0].settings
      part = judge_lib.JudgePart(settings, generate)  # an empty cache each time
      start = time.perf_counter()
      values = part.score_batch(records)
      seconds = time.perf_counter() - start
      if attempt == "cold":
        cold[name] = seconds
        continue
      m = part.metrics()
      rows.append(dict(variant=name, values=values, calls=int(m["calls"]), seconds=seconds,
                       cold_seconds=cold[name], unparseable=int(m["unparseable"]),
                       cache_hits=int(m["cache_hits"])))
  if args.show:
    alone = next(row for row in rows if row["variant"] == "alone")["values"]
    replies = generate([judge_lib.render_prompt(args.template, "", r.ground_truth,
                                                " ; ".join(check(r.response,
                                                                 r.ground_truth).candidates))
                        for r in records[:args.show]])
    for record, value, reply in zip(records, alone, replies):
      print(f"{record.ground_truth!r:30.30} {record.response!r:40.40} -> {reply!r} = {value}")

  print(f"judge {model} template={args.template}; load {load_s:.1f} s; first (cold) pass of each "
        f"variant: " + ", ".join(f"{k} {v:.1f} s" for k, v in cold.items()) +
        f"; {len(cases)} cases ({sum(expected)} expected 1)")
  print("| variant | agreement | agree / n | false accepts | false rejects | judge calls | "
        "unparseable | wall s | s per judged item |")
  print("|---|---|---|---|---|---|---|---|---|")
  for row in rows:
    verdicts = [v >= 0.5 for v in row["values"]]
    agree = sum(v == bool(e) for v, e in zip(verdicts, expected))
    false_accept = sum(v and not e for v, e in zip(verdicts, expected))
    false_reject = sum(e and not v for v, e in zip(verdicts, expected))
    per_item = row["seconds"] / row["calls"] if row["calls"] else float("nan")
    print(f"| {row['variant']} | {100 * agree / len(cases):.1f} % | {agree} / {len(cases)} | "
          f"{false_accept} | {false_reject} | {row['calls']} | {row['unparseable']} | "
          f"{row['seconds']:.1f} | {per_item:.3f} |")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


def demo_steps(args) -> None:
  """Judge cost per step of the CPU demo (module docstring)."""
  import collections
  import importlib

  from reasoning_rl import build
  from reasoning_rl.evaluation import completion_record
  from reasoning_rl.sampler.rollout import generate_groups
  from reasoning_rl.verifiers import judge as judge_lib
  from reasoning_rl.verifiers.rewards import build_parts

  config = importlib.import_module("configs.smollm2_arithmetic").get_config()
  model, tokenizer = build.build_policy(config)
  engine = build.build_engine(config, model)
  template = build.build_template(config, tokenizer)
  source = build.build_data(config).train_source
  r = config.rollout
  judge_model = args.model or config.model.path
  base = {"weight": 1.0, "model": judge_model, "template": args.template,
          "extract": "final_answer"}
  generate = judge_lib.EngineJudge.load(build_parts({"judge": base})[0].settings)
  statuses = collections.Counter()
  table = []
  for step in range(args.demo_steps):
    examples = [source.example(step * r.num_prompts + i) for i in range(r.num_prompts)]
    start = time.perf_counter()
    completions = generate_groups(engine, [template.encode(e) for e in examples],
                                  num_samples=r.num_samples, sampling=build.sampling_params(config),
                                  max_new_tokens=r.max_new_tokens, stop_ids=tokenizer.eos_ids,
                                  seed=step)
    sample_s = time.perf_counter() - start
    records = [completion_record(examples[c.prompt_id], c.scored_text(tokenizer),
                                 num_tokens=len(c.completion_ids), truncated=c.truncated,
                                 max_new_tokens=r.max_new_tokens) for c in completions]
    row = {"step": step, "sample_s": sample_s}
    for rec in records[:args.show] if step == 0 else ():
      print(f"gold {rec.ground_truth!r}: {rec.response[-70:]!r}")
    for mode in ("fallback", "alone"):
      part = judge_lib.JudgePart(build_parts({"judge": {**base, "mode": mode}})[0].settings,
                                 generate)
      if mode == "fallback":
        statuses.update(part.rule_check(rec).status for rec in records)
      part.score_batch(records)
      m = part.metrics()
      row[mode] = (int(m["calls"]), int(m["cache_hits"]), m["seconds"], int(m["unparseable"]))
    table.append(row)
  print(f"demo steps: {args.demo_steps} x {len(records)} completions; rule statuses "
        f"{dict(statuses)}")
  print("| step | sample s | fallback calls | fallback judge s | alone calls (cache hits) | "
        "alone judge s | alone unparseable |")
  print("|---|---|---|---|---|---|---|")
  for row in table:
    fb, al = row["fallback"], row["alone"]
    print(f"| {row['step']} | {row['sample_s']:.1f} | {fb[0]} | {fb[2]:.2f} | {al[0]} ({al[1]}) | "
          f"{al[2]:.2f} | {al[3]} |")


if __name__ == "__main__":
  main()
