"""The Python API: load a target (and a drafter) once, then generate or stream text."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .approximate import CompressedPrompt, SpecPC, load_approximation
from .cache.prefix import PrefixCache
from .drafters import DRAFTERS, Drafter
from .engine import Stats, decode, generate
from .governor import Governor
from .errors import SpecDecodeError
from .models.base import CausalLM
from .models.loading import load_model
from .sampling import SamplingParams
from .text import TextAssembler, chat_prompt_ids
from .tune.profile import tuned_drafter


@dataclass
class Chunk:
    text: str  # text completed by this step (may be empty while a multi-byte character is incomplete)
    token_ids: list[int]  # the step's new tokens


@dataclass
class Result:
    text: str
    token_ids: list[int]  # new tokens only
    stats: Stats

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, **self.stats.as_dict()}


DEFAULT_PREFIX_CACHE_MB = 1024


class SpecDecoder:
    """SpecDecoder("qwen2.5-coder-1.5b-instruct", drafter="draft", draft_model="qwen2.5-coder-0.5b-instruct").

    Generations share a prefix cache (cache/prefix.py) of up to prefix_cache_mb megabytes: a prompt that begins
    with an earlier prompt and its answer (the next turn of a chat) or with an earlier prompt's first tokens (a
    shared document or system prompt) prefills only what is new. The output does not change (bit for bit with
    int4/int8 weights); the cached entries are the target's only (drafters read the prompt as before)."""

    def __init__(
        self,
        model: str | CausalLM,
        drafter: str = "none",
        draft_model: str | CausalLM | None = None,
        dtype: str = "bfloat16",
        backend: str = "auto",
        quant: str = "auto",
        draft_quant: str | None = None,  # the draft model's weights (default: quant); the output does not depend on it
        governor: bool = True,  # run plain steps where speculation does not pay (see governor.py)
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,  # earlier requests' KV kept for reuse (0: none)
        kv_cache: str = "auto",  # the KV cache's format: auto (the compute dtype), f32, bf16, int8 (cache/kv.py)
        approximate: str | SpecPC | None = None,  # "specpc:DRAFT_MODEL[+keep=0.25]...": NOT lossless (approximate.py)
        **drafter_options,
    ):
        self.target = load_model(model, dtype, backend, quant, kv_cache)
        self.drafter_name = drafter
        self.draft_model = draft_model  # None, a loaded model, or a folder a head drafter reads itself
        if isinstance(draft_model, str) and not DRAFTERS.get(drafter, Drafter).takes_draft_folder:
            self.draft_model = load_model(draft_model, dtype, backend, quant if draft_quant is None else draft_quant,
                                          kv_cache)
        self.drafter_options = drafter_options
        self.governed = governor
        self.last_governor: Governor | None = None
        self.drafter = self.new_drafter()
        self.tokenizer = self.target.tokenizer
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * 2**20)) if prefix_cache_mb > 0 else None
        self.compressor = approximate or None  # SpecPC where asked: it shortens long prompts before the target reads
        if isinstance(approximate, str):
            self.compressor = load_approximation(approximate, lambda name: self._model(name, dtype, backend, (
                quant if draft_quant is None else draft_quant), kv_cache))

    def _model(self, name: str, *load_options) -> CausalLM:
        """The draft model if it is the one named (one copy in memory), else that model loaded."""
        if isinstance(self.draft_model, CausalLM) and self.draft_model.name == name:
            return self.draft_model
        return load_model(name, *load_options)

    def new_drafter(self):
        """A drafter with its own per-request state (models are shared), for concurrent requests; without options,
        the tuned profile's (-o profile=none: the drafter's defaults)."""
        return tuned_drafter(self.drafter_name, self.target, draft_model=self.draft_model, **self.drafter_options)

    def forget(self) -> None:
        """Drop what earlier generations taught the drafter (suffix's tree of earlier answers, a table of recycled
        tokens) and the governor: the next generation runs as the first did, e.g. to repeat a measurement of the
        same prompt without the drafter having memorised its answer."""
        self.drafter = self.new_drafter()
        self.last_governor = None
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def governor(self) -> Governor | None:
        """The governor of the next generation (none for plain decoding, or when turned off), carrying what the
        previous ones learned on this machine."""
        if not (self.governed and self.drafter.max_nodes):
            return None
        self.last_governor = self.last_governor.for_next_request() if self.last_governor else Governor()
        return self.last_governor

    def encode(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        """Token ids of a prompt: ids as they are, text, or chat messages (with the model's chat template)."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if chat or isinstance(prompt, list):
            if not getattr(self.tokenizer, "chat_template", None):
                raise SpecDecodeError(f"{self.target.name} has no chat template.", "Drop --chat.")
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            return chat_prompt_ids(self.tokenizer, messages)
        return self.tokenizer(prompt)["input_ids"]

    def stream(
        self, prompt, max_new_tokens: int = 128, chat: bool = False, stats: Stats | None = None, **sampling
    ) -> Iterator[Chunk]:
        """Yield each step's new tokens with the text they complete; pass a Stats to read statistics afterwards."""
        compressed = self.compress_prompt(self.encode(prompt, chat))
        text = TextAssembler(self.tokenizer)
        params = SamplingParams(**sampling)
        stats = Stats() if stats is None else stats
        steps = decode(self.target, self.drafter, compressed.token_ids, max_new_tokens, params, stats,
                       governor=self.governor(), prefix_cache=self.prefix_cache)
        for step in steps:
            yield Chunk(text.add(step), step)
        self.mark_approximate(stats, compressed)
        rest = text.flush()
        if rest:
            yield Chunk(rest, [])

    def generate(self, prompt, max_new_tokens: int = 128, chat: bool = False, **sampling) -> Result:
        compressed = self.compress_prompt(self.encode(prompt, chat))
        params = SamplingParams(**sampling)
        tokens, stats = generate(self.target, self.drafter, compressed.token_ids, max_new_tokens, params,
                                 governor=self.governor(), prefix_cache=self.prefix_cache)
        self.mark_approximate(stats, compressed)
        return Result(self.decode_text(tokens), tokens, stats)  # no per-step detokenizing inside the timing

    def compress_prompt(self, ids: list[int]) -> CompressedPrompt:
        """The prompt the target reads: the approximation's shortening of it, or (lossless) the prompt itself."""
        if self.compressor is None:
            return CompressedPrompt.whole(ids)
        return self.compressor.compress(ids)

    def mark_approximate(self, stats: Stats, compressed: CompressedPrompt) -> None:
        """Say in a generation's stats that it answered a compressed prompt (no-op without an approximation)."""
        if self.compressor is not None:
            self.compressor.mark(stats, compressed)

    def decode_text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
