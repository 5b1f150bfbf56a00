"""Peer rows from llama.cpp, through llama-cpp-python (the optional extra `specdecode[llamacpp]`).

`llama.cpp` is its plain decoding and `llama.cpp-pld` its prompt-lookup speculative decoding
(LlamaPromptLookupDecoding: the n-gram lookup of Saxena's prompt-lookup decoding, up to 10 tokens after the
first earlier match of the last 2 tokens, verified in one batch; the same settings as `hf-pld`). Both run the
target's GGUF file, i.e. its quantized weights, where every other row runs the de-quantized ones, so greedy
outputs can differ from `none`. They are fed the very prompt token ids of the other rows (no re-templating),
start from an empty KV cache each time (no prefix reuse, as in our engine), and use torch's thread count.
With a draft model set, llama-cpp-python keeps the logits of every position (prompt included), which makes its
prefill dearer; when sampling, it samples each position and accepts a draft token when the sample equals it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import torch

from ..errors import SpecDecodeError
from ..models.base import CausalLM
from ..models.loading import gguf_file
from .method import Method

# Without AMX's code: llama.cpp's AMX path (weights repacked into an "AMX" buffer) crashes on some Sapphire Rapids
# machines with Q4_K weights (llama.cpp#20824); its AVX-512 kernels and weight repacking stay.
NO_AMX_BUILD = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON "
    "-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON"
)
PLD_NGRAM = 2  # LlamaPromptLookupDecoding's default, as transformers' prompt lookup
PLD_TOKENS = 10
CONTEXT_STEP = 2048  # the context grows in these steps when a prompt needs more


def llama_cpp():
    """The llama_cpp module, or a SpecDecodeError saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise SpecDecodeError(
            "the llama.cpp rows need llama-cpp-python, which is not installed.",
            "Install it with `pip install 'specdecode[llamacpp]'` (it compiles llama.cpp: minutes).",
        ) from None
    return llama_cpp


class CountingLookup:
    """LlamaPromptLookupDecoding that counts its calls and the tokens it proposes. Llama.generate calls its
    draft model once before every forward pass but the prefill, so a generation takes 1 + calls forwards."""

    def __init__(self, lookup):
        self.lookup = lookup
        self.calls = self.drafted_tokens = 0

    def __call__(self, input_ids, **kwargs):
        proposal = self.lookup(input_ids, **kwargs)
        self.calls += 1
        self.drafted_tokens += len(proposal)
        return proposal


class LlamaCppMethod(Method):
    def __init__(self, label: str, target: CausalLM, prompt_lookup: bool):
        module = llama_cpp()
        self.label, self.target, self.llama_class = label, target, module.Llama
        self.draft = CountingLookup(_prompt_lookup(module)(PLD_NGRAM, PLD_TOKENS)) if prompt_lookup else None
        self.path = gguf_file(target.name)
        check_runs(self.path)
        self.llm = None

    def run(self, prompt_ids, max_new_tokens, params):
        max_new_tokens = min(max_new_tokens, self.target.max_context - len(prompt_ids))
        llm = self._llama(len(prompt_ids) + max_new_tokens + PLD_TOKENS + 1)
        llm.reset()  # an empty KV cache: generate() would otherwise reuse a shared prefix of the last prompt
        llm.set_seed(params.seed if params.seed is not None else 0)
        if self.draft:
            self.draft.calls = self.draft.drafted_tokens = 0
        tokens, prefill_seconds = [], 0.0
        start = time.perf_counter()
        for token in llm.generate(prompt_ids, temp=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                  min_p=0.0, repeat_penalty=1.0):
            if not tokens:
                prefill_seconds = time.perf_counter() - start
            tokens.append(token)
            if token in self.target.eos_token_ids or len(tokens) >= max_new_tokens:
                break
        seconds = time.perf_counter() - start
        record = {"token_ids": tokens, "new_tokens": len(tokens), "seconds": seconds,
                  "prefill_seconds": prefill_seconds, "target_forwards": len(tokens)}
        if self.draft:
            forwards = 1 + self.draft.calls
            record.update(target_forwards=forwards, drafted_tokens=self.draft.drafted_tokens,
                          accepted_tokens=max(0, len(tokens) - forwards))
        return record

    def _llama(self, needed: int):
        """The Llama object, rebuilt (outside the timed part) with a larger context when a prompt needs one."""
        if self.llm is None or self.llm.n_ctx() < needed:
            n_ctx = min(self.target.max_context, -(-needed // CONTEXT_STEP) * CONTEXT_STEP)
            self.llm = None  # free the old context before allocating the new one
            self.llm = self.llama_class(
                model_path=str(self.path), n_ctx=n_ctx, n_threads=torch.get_num_threads(),
                n_threads_batch=torch.get_num_threads(), draft_model=self.draft, verbose=False,
                logits_all=self.draft is not None,  # Llama sizes its logits store by this flag, not by draft_model
            )
        return self.llm


@lru_cache(maxsize=None)
def check_runs(path: Path) -> None:
    """Generates a few tokens from `path` in a child process first: where llama.cpp crashes on this machine, the
    bench stops with the cause and the fix before it starts, instead of dying with every row it measured."""
    probe = (
        "import itertools, llama_cpp, sys; llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=128, verbose=False); "
        "list(itertools.islice(llm.generate(list(range(1, 48))), 4))"
    )
    result = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True)
    if result.returncode == 0:
        return
    info = llama_cpp().llama_print_system_info().decode(errors="replace")
    if "AMX_INT8 = 1" in info:
        raise SpecDecodeError(
            f"llama.cpp crashed running {path.name} here (exit {result.returncode}): its AMX path does so on some "
            "Sapphire Rapids machines (llama.cpp#20824).",
            f"Rebuild llama-cpp-python without it: CMAKE_ARGS=\"{NO_AMX_BUILD}\" pip install --force-reinstall "
            "--no-deps --no-cache-dir llama-cpp-python==0.3.36 (it compiles llama.cpp: minutes), or leave out the "
            "llama.cpp rows.",
        )
    tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
    raise SpecDecodeError(
        f"llama.cpp failed running {path.name} here (exit {result.returncode}: {tail}).",
        "Leave out the llama.cpp rows, or reinstall llama-cpp-python (`pip install 'specdecode[llamacpp]'`).",
    )


def _prompt_lookup(module):
    try:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise SpecDecodeError(
            f"llama-cpp-python {module.__version__} has no prompt-lookup decoding.",
            "Install the version `pip install 'specdecode[llamacpp]'` pins.",
        ) from None
    return LlamaPromptLookupDecoding
