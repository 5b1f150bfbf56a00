"""`specdecode train KIND` (a registered head kind: heads/kinds.py): data, features, draft vocabulary, training,
held-out acceptance. What differs between kinds (the features they read, their start, their loss) is the kind's.

Steps, each resumable (rerun the same command to continue):
1. sequences: ShareGPT prompts (data/sharegpt.py) with the dataset's answers (or the target's, regenerated), up to
   `max_tokens` tokens in all; 2. features: one target forward per sequence, into sharded safetensors
   (extract.py); 3. the draft vocabulary (kinds that draft over their own: EAGLE-3's d2t/t2d, the exit heads'): the
   `draft_vocab` most frequent answer tokens;
4. training: AdamW (0.9, 0.95), linear warm-up then cosine decay, bfloat16 autocast, gradient accumulation,
   gradient clipping, the kind's loss; a checkpoint after every epoch (and when `hours` runs out), from
   which a rerun resumes; 5. after every epoch, tau (tokens per target forward) of the drafter with this head on
   held-out ShareGPT prompts, greedy; the head is saved to OUT/head and to the cache where the drafters find it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import SpecDecodeError
from ..heads import head_kind
from ..heads import target as target_side
from ..heads.store import cache_dir, save_head
from ..data.sharegpt import sharegpt_text, split
from ..text import prompt_ids
from .extract import FeatureStore, chat_sequences

REGENERATION_BATCH = 64  # prompts per batched generate (transformers backend): larger batches cost less per token


@dataclass
class Budget:
    """How much data and compute a run spends; defaults are the small budget (minutes on a 2-core CPU for a
    ~100M-parameter target)."""

    # training tokens (prompt + answer) extracted, and passes over them: more data beat more passes on held-out tau
    # (the EAGLE-3 training report), within ~15 minutes for SmolLM2-135M on 2 cores
    max_tokens: int = 170_000
    epochs: int = 3
    hours: float = 0.0  # wall-clock limit of this run's training (0 = none); rerun to continue
    answer_tokens: int = 96  # answer length (regenerated, or the dataset's cut there)
    max_prompt: int = 160  # longer prompts are skipped
    # ShareGPT's answers by default: the loss's labels are the target's own distributions at every position either
    # way, and without regeneration the same minutes extract ~2.5x the tokens, which gave the head more (see the
    # EAGLE-3 training report); --regenerate trains on the target's own answers.
    regenerate: bool = False
    draft_vocab: int = 8192  # eagle3, kangaroo, eesd
    exit_layer: int = 0  # kangaroo, eesd: the target layer whose input the head reads (0: heads.target's default)
    ttt_steps: int = 3  # eagle3: training-time-test steps
    # eagle, eagle3, eesd: the head layer's MLP width (0: the target's). A narrower MLP trains faster per token on a
    # CPU, where a large target's head is slow to train (its LM head and MLP dominate a step)
    intermediate_size: int = 0
    # eagle3: the head's layer starts from the target's last layer (Eagle3Head.start_from) where it is a Llama block
    warm_start: bool = True
    prompt_weight: float = 1.0  # eagle3: loss weight of the prompt's positions (the answer's weigh 1)
    medusa_heads: int = 3
    lr: float = 1e-3
    warmup: int = 10  # optimizer steps
    batch: int = 2  # sequences per micro-batch
    accumulate: int = 1  # micro-batches per optimizer step
    held_out: int = 4  # ShareGPT prompts kept apart for tau
    eval_tokens: int = 48  # new tokens per held-out prompt
    seed: int = 0


def scaled_budget(target, **given) -> Budget:
    """The default budget, grown for larger targets (more data, a larger draft vocabulary)."""
    d = target_side.hidden_size(target)
    base = Budget() if d <= 1024 else Budget(
        max_tokens=200_000, answer_tokens=192, max_prompt=384, draft_vocab=32_000, held_out=8, eval_tokens=96
    )
    return Budget(**{**asdict(base), **{k: v for k, v in given.items() if v is not None}})


def train(kind: str, target, out: Path, budget: Budget, device: str = "cpu", bf16: bool = True) -> dict:
    """Run (or resume) every step; returns the report (also written to OUT/report.json)."""
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(budget.seed)
    store = prepare_features(kind, target, out, budget)
    sequences = store.load()
    head = initial_head(kind, target, sequences, budget)
    run = TrainingRun(kind, head, target, sequences, out, budget, device, bf16)
    report = run.run(held_out_prompts(target, budget))
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def held_out_prompts(target, budget: Budget) -> list[list[int]]:
    """Prompt ids (chat template, or plain text for a base model) of the held-out ShareGPT conversations (never
    trained on)."""
    if not budget.held_out:
        return []
    convs = split(sharegpt_text(), 0, budget.held_out)[1]
    prompts = [prompt_ids(target.tokenizer, [{"role": "user", "content": c.prompt}]) for c in convs]
    return [p for p in prompts if len(p) <= 4 * budget.max_prompt]


def prepare_features(kind: str, target, out: Path, budget: Budget) -> FeatureStore:
    fused = head_kind(kind).reads_layer_states
    layers = head_kind(kind).feature_layers(target, budget.exit_layer) if fused else []
    quant = getattr(target, "quant", "none")  # named only when quantized: dense features made before stay valid
    settings = {"target": target.name, **({"quant": quant} if quant != "none" else {}),
                "max_tokens": budget.max_tokens, "answer_tokens": budget.answer_tokens, "max_prompt": budget.max_prompt,
                "regenerate": budget.regenerate, "fused": fused, "layers": layers}
    store = FeatureStore(out / "features" / ("fused" if fused else "last"))
    if store.matches(settings) and store.complete:
        return store
    convs = split(sharegpt_text(), 10**9, budget.held_out)[0]
    per_sequence = budget.max_prompt // 2 + budget.answer_tokens  # a first guess of a sequence's length
    sequences, total, first = [], 0, 0
    while total < budget.max_tokens and first < len(convs):  # more conversations until max_tokens is reached
        chunk = convs[first : first + max(8, (budget.max_tokens - total) // per_sequence + 1)]
        first += len(chunk)
        for seq in chat_sequences(target, chunk, budget.regenerate, budget.answer_tokens, budget.max_prompt,
                                  REGENERATION_BATCH):
            if total >= budget.max_tokens:
                break
            sequences.append(seq)
            total += len(seq.ids)
    store.extract(target, sequences, layers, fused, settings)
    return store


def draft_vocabulary(sequences: list[dict], size: int, vocab: int) -> torch.Tensor:
    """[size] ascending target ids: the most frequent answer tokens (ties to the lower id); if the answers hold fewer
    distinct tokens (a small budget, a large vocabulary), then the most frequent prompt tokens (the same kind of
    text), then the lowest unused ids."""
    answers = torch.zeros(vocab, dtype=torch.long)
    prompts = torch.zeros(vocab, dtype=torch.long)
    for seq in sequences:
        answers += torch.bincount(seq["ids"][seq["prompt_len"] :], minlength=vocab)
        prompts += torch.bincount(seq["ids"][: seq["prompt_len"]], minlength=vocab)
    order = torch.argsort(-(answers * (int(prompts.max()) + 1) + prompts), stable=True)[:size]  # ties: lower id
    return order.sort().values


def initial_head(kind: str, target, sequences: list[dict], budget: Budget):
    """The head training starts from: built with the budget's sizes, its draft vocabulary (if its kind has one) the
    training answers' most frequent tokens, then started as its kind starts it (HeadKind.prepare)."""
    spec = head_kind(kind)
    overrides = spec.config_overrides(target, budget)
    if budget.intermediate_size:
        overrides["intermediate_size"] = budget.intermediate_size
    if spec.draft_vocabulary:
        overrides["draft_vocab_size"] = min(budget.draft_vocab, target.vocab_size)
    head = target_side.new_head(kind, target, seed=budget.seed, **overrides)
    if spec.draft_vocabulary:
        head.set_vocabulary(draft_vocabulary(sequences, head.config.draft_vocab_size, target.vocab_size))
    spec.prepare(head, target, budget)
    return head


class TrainingRun:
    def __init__(self, kind, head, target, sequences, out: Path, budget: Budget, device: str, bf16: bool):
        self.kind, self.head, self.target, self.out, self.budget = kind, head.to(device), target, out, budget
        self.device, self.bf16 = device, bf16
        self.batches = make_batches(sequences, budget.batch)
        self.frozen = {k: v.to(device) for k, v in head_kind(kind).frozen(target, head).items()}
        self.decoding_target = None  # where held-out tau is measured (made on first use)
        steps_per_epoch = math.ceil(len(self.batches) / budget.accumulate)
        self.total_steps = steps_per_epoch * budget.epochs
        trainable = [p for p in head.parameters() if p.requires_grad]
        # fused: one pass over each parameter's state per step instead of one per elementwise operation
        self.optimizer = torch.optim.AdamW(trainable, lr=budget.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_factor)
        self.state = {"epoch": 0, "batch": 0, "history": [], "train_seconds": 0.0}
        self.checkpoint = out / "checkpoint.pt"
        if self.checkpoint.exists():
            self.resume()

    def lr_factor(self, step: int) -> float:
        if step < self.budget.warmup:
            return (step + 1) / self.budget.warmup
        progress = (step - self.budget.warmup) / max(1, self.total_steps - self.budget.warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def resume(self) -> None:
        saved = torch.load(self.checkpoint, map_location=self.device, weights_only=False)
        if saved["kind"] != self.kind or saved["config"] != json.loads(self.head.config.to_json()):
            raise SpecDecodeError(f"{self.checkpoint} belongs to another head or budget.", "Use another --out folder.")
        self.head.load_state_dict(saved["head"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.state = saved["state"]
        print(f"resuming at epoch {self.state['epoch'] + 1}, batch {self.state['batch']}")

    def save(self) -> None:
        tmp = self.checkpoint.with_suffix(".tmp")
        torch.save({"kind": self.kind, "config": json.loads(self.head.config.to_json()), "head": self.head.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "state": self.state}, tmp)
        tmp.replace(self.checkpoint)

    def run(self, held_out_prompts: list[list[int]]) -> dict:
        deadline = time.monotonic() + self.budget.hours * 3600 if self.budget.hours else None
        finished = True
        while self.state["epoch"] < self.budget.epochs:
            if not self.train_epoch(deadline):
                finished = False
                self.publish_partial(held_out_prompts)
                break
            self.state.pop("stopped", None)  # a partial epoch's tau, now superseded
            tau = self.evaluate(held_out_prompts)
            self.state["history"][-1]["tau"] = tau
            print(f"epoch {self.state['epoch']}: tau {tau:.2f} on {len(held_out_prompts)} held-out prompts")
            self.save()
            self.publish()
        self.save()
        return {"kind": self.kind, "target": self.target.name, "finished": finished, "budget": asdict(self.budget),
                "sequences": sum(len(b["ids"]) for b in self.batches),
                "tokens": int(sum(int(b["valid"].sum()) for b in self.batches)), **self.state,
                "head": str(cache_dir(self.target.name, self.kind))}

    def publish_partial(self, held_out_prompts: list[list[int]]) -> None:
        """The time ran out mid-epoch: the head as it stands is still the best this run has, so measure its held-out
        tau (state["stopped"]: where, and that tau) and publish it; a rerun resumes from the checkpoint."""
        if not self.state["batch"]:
            return
        tau = self.evaluate(held_out_prompts)
        self.state["stopped"] = {"epoch": self.state["epoch"] + 1, "batch": self.state["batch"], "tau": tau}
        print(f"stopped in epoch {self.state['epoch'] + 1} after {self.state['batch']} batches: tau {tau:.2f}")
        self.publish()

    def train_epoch(self, deadline) -> bool:
        """One epoch from the saved position; False if the time ran out first (a checkpoint is saved)."""
        epoch = self.state["epoch"]
        order = torch.randperm(len(self.batches), generator=torch.Generator().manual_seed(self.budget.seed + epoch))
        self.head.train()
        bar = tqdm(total=len(order), initial=self.state["batch"], desc=f"{self.kind} epoch {epoch + 1}/{self.budget.epochs}",
                   unit="batch")
        started, sums = time.monotonic(), {"loss": 0.0, "acc": 0.0, "n": 0}
        while self.state["batch"] < len(order):
            if deadline is not None and time.monotonic() > deadline:
                self.state["train_seconds"] += time.monotonic() - started
                self.save()
                bar.close()
                print(f"time budget reached in epoch {epoch + 1}; checkpoint saved, rerun to continue")
                return False
            index = self.state["batch"]
            loss, metrics = self.micro_step(self.batches[int(order[index])])
            if (index + 1) % self.budget.accumulate == 0 or index + 1 == len(order):
                torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
            sums["loss"] += loss
            sums["acc"] += metrics["acc"]
            sums["n"] += 1
            self.state["batch"] += 1
            bar.update(1)
            bar.set_postfix(loss=f"{sums['loss'] / sums['n']:.3f}", acc=f"{sums['acc'] / sums['n']:.2f}")
        bar.close()
        self.state["train_seconds"] += time.monotonic() - started
        self.state["history"].append({"epoch": epoch + 1, "loss": sums["loss"] / max(1, sums["n"]),
                                      "acc": sums["acc"] / max(1, sums["n"])})
        self.state["epoch"] += 1
        self.state["batch"] = 0
        return True

    def micro_step(self, batch: dict) -> tuple[float, dict]:
        batch = {k: v.to(self.device) for k, v in batch.items()}
        device_type = "cuda" if str(self.device).startswith("cuda") else "cpu"
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.bf16):
            loss, metrics = head_kind(self.kind).loss(self.head, batch, self.frozen, self.budget)
        (loss / self.budget.accumulate).backward()
        return float(loss.detach()), metrics

    def publish(self) -> None:
        """The current head into OUT/head and the cache the drafters search."""
        head = self.head.to("cpu").eval()
        save_head(head, self.out / "head")
        save_head(head, cache_dir(self.target.name, self.kind))
        self.head.to(self.device)

    @torch.no_grad()
    def evaluate(self, prompts: list[list[int]]) -> float:
        """Tau of greedy decoding with this head on the held-out prompts (the CPU copy of the head)."""
        from ..drafters import build_drafter
        from ..engine import generate
        from ..sampling import SamplingParams

        if not prompts:
            return 0.0
        head = self.head.to("cpu").eval()
        self.decoding_target = self.decoding_target or decoding_target(self.kind, self.target)
        drafter = build_drafter(head_kind(self.kind).drafter, self.decoding_target, draft_model=head)
        new = forwards = 0
        for prompt in tqdm(prompts, desc="held-out tau", unit="prompt", leave=False):
            _, stats = generate(self.decoding_target, drafter, prompt, self.budget.eval_tokens, SamplingParams())
            new, forwards = new + stats.new_tokens, forwards + stats.target_forwards
        self.head.to(self.device).train()
        return new / max(1, forwards)


def decoding_target(kind: str, target):
    """The target held-out tau decodes with: the target itself, or, for a drafter that runs a part of it (kangaroo,
    eesd) when it runs on transformers (the trainer's default backend, for batched regeneration), its native twin
    (the same weights)."""
    from ..drafters import DRAFTERS
    from ..models.hf import HFModel
    from ..models.native import from_transformers, supported

    if not DRAFTERS[head_kind(kind).drafter].needs_sublayers or target.runs_sublayers:
        return target
    if not isinstance(target, HFModel) or not supported(target.model.config.get_text_config(decoder=True)):
        raise SpecDecodeError(f"the {kind} drafter cannot run on {target.name}'s backend.",
                              "Train with --backend native (Llama, SmolLM2, Qwen2 and Gemma 3 models).")
    return from_transformers(target.model, target.tokenizer, target.name)


def make_batches(sequences: list[dict], size: int) -> list[dict]:
    """Sequences of similar length padded (right) into batches: ids [B, T], last [B, T, d], fused, valid [B, T] (the
    answer tokens), real [B, T] (every token, padding excluded)."""
    ordered = sorted(sequences, key=lambda s: s["ids"].shape[0])
    batches = []
    for first in range(0, len(ordered), size):
        group = ordered[first : first + size]
        width = max(s["ids"].shape[0] for s in group)
        batch = {"ids": torch.zeros(len(group), width, dtype=torch.long),
                 "valid": torch.zeros(len(group), width, dtype=torch.bool),
                 "real": torch.zeros(len(group), width, dtype=torch.bool)}
        for key in ("last", "fused"):
            if key in group[0]:
                batch[key] = torch.zeros(len(group), width, group[0][key].shape[-1], dtype=group[0][key].dtype)
        for row, seq in enumerate(group):
            n = seq["ids"].shape[0]
            batch["ids"][row, :n] = seq["ids"]
            batch["valid"][row, seq["prompt_len"] : n] = True
            batch["real"][row, :n] = True
            for key in ("last", "fused"):
                if key in seq:
                    batch[key][row, :n] = seq[key]
        batches.append(batch)
    return batches
