"""Rows of a benchmark: our drafters through the engine, and peers (transformers' own speculative decoding).

Method specs: NAME[:DRAFT_MODEL][+KEY=VALUE...] for a registered drafter (e.g. `draft:qwen2.5-coder-0.5b-instruct+depth=5`;
two keys are the engine's, not the drafter's: `+governor=false` speculates at every step, `+verify=token` verifies
sampled chains token by token instead of the run's --verification),
`hf-assisted:DRAFT_MODEL` (transformers' assisted generation), `hf-uag:DRAFT_MODEL` (transformers' universal
assisted generation: a draft model of another tokenizer, string-level matching when greedy and token-level
intersection when sampling), `hf-pld` (transformers' prompt lookup), and
`hf-plain` (transformers' own generate, to compare our baseline with), `llama.cpp` / `llama.cpp-pld`
(llama-cpp-python's plain and prompt-lookup decoding of the target's GGUF file; see llamacpp.py), and `openvino` /
`openvino-pld` / `openvino-draft:DRAFT_MODEL` (OpenVINO GenAI's plain, prompt-lookup and draft-model decoding of the
target exported to int4 OpenVINO IR; see openvino.py), and `specpc:DRAFT_MODEL[+keep=0.25][+drafter=NAME]`
(approximate: SpecPC prompt compression, then the drafter on the shorter prompt; see approximate.py). Any spec but
the llama.cpp and openvino ones may end in
@WEIGHTS (`@hf`, `@native`, `@native-int4`, ...) to run on other target weights than the run's --backend/--quant.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..drafters import DRAFTERS
from ..drafters.base import parse_options
from ..engine import generate
from ..governor import Governor
from ..errors import SpecDecodeError
from ..models.base import CausalLM
from ..sampling import SamplingParams
from ..tune.profile import tuned_drafter
from .method import Method


class EngineMethod(Method):
    def __init__(self, label: str, target: CausalLM, make_drafter, governed: bool = True,
                 verification: str | None = None):
        self.label, self.target, self.make_drafter = label, target, make_drafter
        self.verification = verification  # None: the run's
        self.drafter = make_drafter()
        self.governed = governed and self.drafter.max_nodes > 0  # as the API runs it: plain steps where drafting loses
        self.governor: Governor | None = None

    def new_repeat(self) -> None:
        self.drafter = self.make_drafter()  # suffix's and hierarchy's trees of earlier answers start empty again
        self.governor = None

    def run(self, prompt_ids, max_new_tokens, params):
        if self.governed:  # carried from one generation to the next, as the API does
            self.governor = self.governor.for_next_request() if self.governor else Governor()
        governor = self.governor if self.governed else None
        if self.verification:
            params = dataclasses.replace(params, verification=self.verification)
        tokens, stats = generate(self.target, self.drafter, prompt_ids, max_new_tokens, params, governor=governor,
                                 prefix_cache=self.prefix_cache)
        record = stats.as_dict()
        record["token_ids"] = tokens
        record["options"] = dict(
            self.drafter.options, tuned=self.drafter.tuned, sized=self.drafter.sized, governor=self.governed
        )
        return record


class FirstTokenClock:
    """A transformers streamer that notes when the first new token arrives (generate puts the prompt first)."""

    def __init__(self):
        self.start, self.puts, self.first_token_seconds = time.perf_counter(), 0, 0.0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.first_token_seconds = time.perf_counter() - self.start

    def end(self):
        pass


class TransformersMethod(Method):
    """transformers' generate() on the same loaded weights, with its own speculative options."""

    def __init__(self, label: str, target: CausalLM, **generate_options):
        self.label, self.target, self.options = label, target, generate_options

    def run(self, prompt_ids, max_new_tokens, params):
        model = self.target.model
        input_ids = torch.tensor([prompt_ids])
        sampling = (
            dict(do_sample=False)
            if params.greedy
            else dict(do_sample=True, temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
        )
        if params.seed is not None:
            torch.manual_seed(params.seed)
        clock = FirstTokenClock()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                eos_token_id=sorted(self.target.eos_token_ids),
                pad_token_id=sorted(self.target.eos_token_ids)[0],
                repetition_penalty=1.0,
                streamer=clock,
                **sampling,
                **self.options,
            )
        seconds = time.perf_counter() - clock.start
        tokens = out[0, len(prompt_ids) :].tolist()
        return {"token_ids": tokens, "new_tokens": len(tokens), "seconds": seconds,
                "prefill_seconds": clock.first_token_seconds, "target_forwards": None}


class CompressedMethod(Method):
    """Approximate, not lossless: SpecPC compresses the prompt with a draft model, then an engine method (plain
    decoding, or a drafter: lossless with respect to the shorter prompt) answers it. The compression counts in the
    row's time to first token; the record says how many tokens the target read. The shared prefill of the run's
    full prompts is of no use to it (its prompt is another)."""

    def __init__(self, label: str, compressor, inner: EngineMethod):
        self.label, self.compressor, self.inner = label, compressor, inner

    def new_repeat(self) -> None:
        self.inner.new_repeat()

    def run(self, prompt_ids, max_new_tokens, params):
        compressed = self.compressor.compress(prompt_ids)
        record = self.inner.run(compressed.token_ids, max_new_tokens, params)
        record.update(approximate=True, compressed_prompt_tokens=len(compressed.token_ids),
                      compression_seconds=compressed.seconds)
        record["prefill_seconds"] += compressed.seconds
        record["seconds"] += compressed.seconds
        record["tokens_per_second"] = record["new_tokens"] / record["seconds"]
        return record


def _specpc_method(spec: str, head: str, target: CausalLM, load) -> Method:
    """specpc:DRAFT_MODEL[+keep=0.25][+read_window=1024]...[+drafter=NAME]: SpecPC's options (approximate.SpecPC),
    and the drafter that decodes the compressed prompt (default none)."""
    from ..approximate import load_approximation

    pairs = head.split("+")
    drafters = [pair.partition("=")[2] for pair in pairs if pair.startswith("drafter=")]
    drafter = drafters[-1] if drafters else "none"
    if drafter not in DRAFTERS or DRAFTERS[drafter].needs_draft_model:
        raise SpecDecodeError(f"'{spec}': drafter '{drafter}' cannot decode a compressed prompt here.",
                              "Use +drafter=none, pld, suffix or another drafter without a draft model.")
    approximation = "+".join(pair for pair in pairs if not pair.startswith("drafter="))
    compressor = load_approximation(approximation, lambda name: load(name, draft=True))
    inner = EngineMethod(spec, target, lambda: tuned_drafter(drafter, target))
    return CompressedMethod(spec, compressor, inner)


def build_method(spec: str, target: CausalLM, load) -> Method:
    """`load(model_spec, weights=None)` returns a CausalLM in the run's dtype, on the run's backend and quant or on
    `weights` ('hf', 'native-int4', ...), cached by the caller. A spec's @WEIGHTS suffix picks the target's."""
    if spec in ("llama.cpp", "llama.cpp-pld"):  # llama.cpp runs the GGUF file, whatever the run's weights
        from .llamacpp import LlamaCppMethod  # llama-cpp-python is an optional extra

        return LlamaCppMethod(spec, target, prompt_lookup=spec == "llama.cpp-pld")
    if spec.split(":", 1)[0] in ("openvino", "openvino-pld", "openvino-draft"):  # OpenVINO runs its own int4 IR
        from .openvino import build  # openvino-genai is an optional extra

        return build(spec, target)
    head, _, weights = spec.partition("@")
    if weights:
        target = load(target.name, weights)
    if head.startswith("hf-"):
        return _transformers_method(spec, head, target, load)
    if head.startswith("specpc:"):
        return _specpc_method(spec, head, target, load)
    name, *option_pairs = head.split("+")
    name, _, draft_model = name.partition(":")
    if name not in DRAFTERS:
        raise SpecDecodeError(
            f"unknown method '{spec}'.",
            f"Use a drafter ({', '.join(sorted(DRAFTERS))}), hf-plain, hf-pld, hf-assisted:MODEL, hf-uag:MODEL, "
            "llama.cpp, llama.cpp-pld, openvino, openvino-pld or openvino-draft:MODEL.",
        )
    options = parse_options(option_pairs)
    governed = bool(options.pop("governor", True))  # +governor=false: speculate at every step
    verification = options.pop("verify", None)  # +verify=token: this row verifies sampled chains token by token
    if verification is not None:
        SamplingParams(verification=str(verification))  # a clear message for an unknown rule
    draft = draft_model or None  # a head drafter reads its folder itself
    if draft_model and not DRAFTERS[name].takes_draft_folder:
        draft = load(draft_model, weights or None, draft=True)
    return EngineMethod(spec, target, lambda: tuned_drafter(name, target, draft_model=draft, **options), governed,
                        verification and str(verification))


def _transformers_method(spec: str, head: str, target: CausalLM, load) -> Method:
    from ..models.hf import HFModel

    if not isinstance(target, HFModel):  # transformers' generate needs its own model object
        target = load(target.name, "hf")
    if head == "hf-plain":
        return TransformersMethod(spec, target)
    if head == "hf-pld":
        return TransformersMethod(spec, target, prompt_lookup_num_tokens=10)
    if head.startswith("hf-assisted:"):
        return TransformersMethod(spec, target, assistant_model=load(head.split(":", 1)[1], "hf").model)
    if head.startswith("hf-uag:"):
        assistant = load(head.split(":", 1)[1], "hf")
        return TransformersMethod(spec, target, assistant_model=assistant.model, tokenizer=target.tokenizer,
                                  assistant_tokenizer=assistant.tokenizer)
    raise SpecDecodeError(f"unknown method '{spec}'.", "Use hf-plain, hf-pld, hf-assisted:MODEL or hf-uag:MODEL.")
