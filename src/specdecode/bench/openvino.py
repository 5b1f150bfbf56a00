"""Peer rows from OpenVINO GenAI (the optional extra `specdecode[openvino]`): `openvino` is its LLMPipeline's plain
greedy (or sampled) decoding, `openvino-pld` its prompt-lookup decoding and `openvino-draft:MODEL` its speculative
decoding with a draft model, both with 5 candidate tokens per step as OpenVINO GenAI's own samples use (prompt
lookup: n-grams of up to 3 tokens).

They run the model exported to OpenVINO IR with int4 weights (`optimum-cli export openvino --weight-format int4
--group-size 32 --sym`: NNCF's data-free int4 compression, groups of 32, symmetric; embeddings and the output layer
stay in int8 as NNCF keeps them), i.e. other weights than every other row, so their greedy outputs are compared with
the plain `openvino` row, not with `none`. The export runs once per model, cached under
~/.cache/specdecode/peers/openvino/<model>-int4/, through optimum-intel, which pins a transformers and
huggingface-hub older than ours: it is installed into its own virtual environment
(~/.cache/specdecode/peers/openvino-export-venv, created on first use) and run there as a child process. Generation
runs in this process (openvino-genai does not conflict with our dependencies).

The rows are fed the very prompt token ids of the other rows (an ov.Tensor of input ids: no re-templating), use
torch's thread count (INFERENCE_NUM_THREADS, draft model included), start without prefix caching (no reuse of an
earlier prompt's KV cache, as in our engine), and report OpenVINO GenAI's own time to first token (its PerfMetrics).
Otherwise OpenVINO's CPU defaults hold (bf16 inference where the CPU has it, int8 dynamic quantization of
activations, u8 KV cache, its paged-attention continuous-batching backend, which its prompt-lookup and draft-model
pipelines need): those compute one-token steps and multi-token verification differently, so `openvino-pld` and
`openvino-draft:` can leave `openvino`'s greedy path at near-ties (EXACT_PROPERTIES makes them agree, slower).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..errors import SpecDecodeError
from .. import files
from ..models import packaged
from ..models.base import CausalLM
from ..sampling import SamplingParams
from .method import Method

OPENVINO_GENAI = "openvino-genai==2026.4.1.0"  # the `openvino` extra's pin; brings openvino 2026.4.1
INSTALL_HINT = "Install it with `pip install 'specdecode[openvino]'` (openvino-genai 2026.4.1)."
# optimum-intel's export, in its own environment: it needs transformers < 5.6 and huggingface-hub < 1.22. The
# openvino and openvino-tokenizers pins match what openvino-genai 2026.4.1.0 runs.
EXPORT_REQUIREMENTS = (
    "optimum-intel[openvino]==2.2.0",
    "optimum==2.3.0",
    "nncf==3.4.0",
    "openvino==2026.4.1",
    "openvino-tokenizers==2026.4.1.0",
    "transformers==5.5.4",
    "huggingface-hub==1.21.0",
)
EXPORT_OPTIONS = ("--weight-format", "int4", "--group-size", "32", "--sym")
WEIGHTS = "OpenVINO int4 IR (NNCF, group 32, sym)"
CANDIDATE_TOKENS = 5  # num_assistant_tokens of OpenVINO GenAI's prompt-lookup and speculative decoding samples
PLD_NGRAM = 3  # max_ngram_size of its prompt-lookup sample
PLAIN, PLD, DRAFT = "openvino", "openvino-pld", "openvino-draft"
# OpenVINO's CPU defaults compute one-token steps and multi-token verification differently (bf16 inference, int8
# dynamic quantization of activations, u8 KV cache), so its speculative outputs can leave its own plain greedy path
# at near-ties; with these properties they do not (measured on SmolLM2: either change alone was not enough)
EXACT_PROPERTIES = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def openvino_genai():
    """The openvino_genai module, or a SpecDecodeError saying how to install it."""
    try:
        import openvino_genai
    except ImportError:
        raise SpecDecodeError("the OpenVINO rows need openvino-genai, which is not installed.", INSTALL_HINT) from None
    return openvino_genai


def parse_spec(spec: str) -> tuple[str, str | None]:
    """('openvino' | 'openvino-pld' | 'openvino-draft', draft model or None), or a SpecDecodeError."""
    if spec in (PLAIN, PLD):
        return spec, None
    head, _, draft = spec.partition(":")
    if head != DRAFT:
        raise SpecDecodeError(f"unknown method '{spec}'.", "Use openvino, openvino-pld or openvino-draft:MODEL.")
    if not draft:
        raise SpecDecodeError(f"'{spec}' names no draft model.",
                              f"Use openvino-draft:MODEL, MODEL one of {', '.join(packaged.SHIPPED)} or a folder.")
    if draft not in packaged.SHIPPED and not (Path(draft).expanduser() / "config.json").is_file():
        raise SpecDecodeError(
            f"unknown draft model '{draft}' in '{spec}': not a shipped name or a transformers folder.",
            f"Use one of {', '.join(packaged.SHIPPED)} or a folder with config.json.",
        )
    return DRAFT, draft


class OpenVINOMethod(Method):
    """One OpenVINO GenAI LLMPipeline on the CPU, with OpenVINO's default CPU settings (bf16 inference where the CPU
    has it, int8 dynamic quantization of activations, u8 KV cache) unless `properties` override them."""

    def __init__(self, label: str, target: CausalLM, kind: str, draft_model: str | None = None,
                 properties: dict | None = None):
        genai = openvino_genai()
        self.label, self.target, self.kind, self.genai = label, target, kind, genai
        self.threads = torch.get_num_threads()
        self.path = exported(target.name)
        self.draft_path = exported(draft_model) if draft_model else None
        properties = {"INFERENCE_NUM_THREADS": self.threads, **(properties or {})}
        scheduler = genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False  # every prompt from an empty KV cache, as the other rows
        options: dict = {"scheduler_config": scheduler}
        if kind == PLD:
            options["prompt_lookup"] = True
        elif kind == DRAFT:
            options["draft_model"] = genai.draft_model(str(self.draft_path), "CPU", **properties)
        self.pipe = genai.LLMPipeline(str(self.path), "CPU", **options, **properties)
        self.version = _version()

    def run(self, prompt_ids, max_new_tokens, params):
        import openvino

        config = self._config(min(max_new_tokens, self.target.max_context - len(prompt_ids)), params)
        input_ids = openvino.Tensor(torch.tensor([prompt_ids], dtype=torch.int64).numpy())
        start = time.perf_counter()
        result = self.pipe.generate(input_ids, config)
        seconds = time.perf_counter() - start
        tokens = [int(t) for t in result.tokens[0]]
        metrics = result.perf_metrics
        record = {"token_ids": tokens, "new_tokens": len(tokens), "seconds": seconds,
                  "prefill_seconds": metrics.get_ttft().mean / 1000, "target_forwards": None,
                  "weights": WEIGHTS, "engine": f"openvino-genai {self.version}",
                  # OpenVINO GenAI's own figures: time to first token (ms), tokens/s after it, ms per output token
                  "openvino_metrics": {"ttft_ms": metrics.get_ttft().mean, "throughput": metrics.get_throughput().mean,
                                       "tpot_ms": metrics.get_tpot().mean,
                                       "generate_ms": metrics.get_generate_duration().mean}}
        if self.kind == PLAIN:
            record["target_forwards"] = len(tokens)
        return record

    def _config(self, max_new_tokens: int, params: SamplingParams):
        config = self.genai.GenerationConfig()  # not the exported generation_config.json: the run's settings only
        config.max_new_tokens = max(1, max_new_tokens)
        eos = sorted(self.target.eos_token_ids)
        config.eos_token_id = eos[0]
        config.stop_token_ids = set(eos)
        config.repetition_penalty = 1.0
        if params.greedy:
            config.do_sample = False
        else:
            config.do_sample, config.temperature, config.top_p = True, params.temperature, params.top_p
            if params.top_k:
                config.top_k = params.top_k
            config.rng_seed = params.seed if params.seed is not None else 0
        if self.kind == PLD:
            config.num_assistant_tokens, config.max_ngram_size = CANDIDATE_TOKENS, PLD_NGRAM
        elif self.kind == DRAFT:
            config.num_assistant_tokens = CANDIDATE_TOKENS
        return config


def build(spec: str, target: CausalLM, properties: dict | None = None) -> OpenVINOMethod:
    kind, draft = parse_spec(spec)
    return OpenVINOMethod(spec, target, kind, draft, properties)


def export_root() -> Path:
    return files.cache_root() / "peers"


def export_dir(spec: str) -> Path:
    """Where the int4 IR of `spec` (a shipped name, or a folder: named by its path's hash) is cached."""
    if spec in packaged.SHIPPED:
        name = spec
    else:
        path = Path(spec).expanduser().resolve()
        name = f"{path.name}-{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    return export_root() / "openvino" / f"{name}-int4"


def exported(spec: str) -> Path:
    """The OpenVINO int4 IR folder of a model, exported once (minutes for a 1.5B model)."""
    out = export_dir(spec)
    if (out / "done").is_file():
        return out
    from ..models.loading import resolve

    source = Path(resolve(spec))
    with files.cache_lock(f"openvino-export-{out.name}"):
        if (out / "done").is_file():
            return out
        python = export_python()
        partial = files.partial_path(out)
        shutil.rmtree(partial, ignore_errors=True)
        command = [str(Path(python).with_name("optimum-cli")), "export", "openvino", "--model", str(source),
                   "--task", "text-generation-with-past", *EXPORT_OPTIONS, str(partial)]
        _say(f"openvino: exporting {spec} to OpenVINO IR, int4 weights (group 32, sym) in {out} "
             "(once per model; minutes for a 1.5B model)")
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0 or not (partial / "openvino_model.xml").is_file():
            shutil.rmtree(partial, ignore_errors=True)
            tail = "\n".join(result.stdout.strip().splitlines()[-5:])
            raise SpecDecodeError(f"exporting {spec} to OpenVINO IR failed (exit {result.returncode}):\n{tail}",
                                  f"Run `{' '.join(command)}` to see why.")
        (partial / "done").write_text(json.dumps({"source": str(source), "options": EXPORT_OPTIONS,
                                                  "requirements": EXPORT_REQUIREMENTS}))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(partial, out)
    _say(f"openvino: exported {spec}")
    return out


def export_requirements() -> list[str]:
    """The export environment's packages: optimum-intel's, and this torch's version (CPU build where ours is)."""
    return [*EXPORT_REQUIREMENTS, f"torch=={torch.__version__}"]


def export_python() -> str:
    """The python of the export environment, created on first use (pip install: a few minutes)."""
    venv = export_root() / "openvino-export-venv"
    python = venv / "bin" / "python"
    wanted = "\n".join(export_requirements())
    marker = venv / "specdecode-requirements.txt"
    if marker.is_file() and marker.read_text() == wanted:
        return str(python)
    with files.cache_lock("openvino-export-venv"):
        if marker.is_file() and marker.read_text() == wanted:
            return str(python)
        _say(f"openvino: creating {venv} for optimum-intel's export (once; downloads ~1 GB): {' '.join(wanted.split())}")
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "--progress-bar", "off", "--disable-pip-version-check"]
        # torch first, alone: its CPU build comes from PyTorch's index (where that host resolves; pip's configured
        # indexes otherwise), which the other packages need not wait for
        torch_index = ["--extra-index-url", TORCH_CPU_INDEX] if "+cpu" in torch.__version__ and _resolves(
            TORCH_CPU_INDEX) else []
        for step in ([*torch_index, f"torch=={torch.__version__}"], wanted.split()):
            result = subprocess.run([*pip, *step], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if result.returncode != 0:
                tail = "\n".join(result.stdout.strip().splitlines()[-5:])
                raise SpecDecodeError(f"installing optimum-intel into {venv} failed:\n{tail}",
                                      "Check the network, or export the model yourself with optimum-cli into "
                                      f"{export_root() / 'openvino'}/<model>-int4/ and write a file named done there.")
        # optimum-intel requires torchvision, whose PyPI build needs CUDA's torch and then breaks `import
        # transformers` next to a CPU torch; an LLM's export does not use it
        if subprocess.run([str(python), "-c", "import torchvision"], capture_output=True).returncode != 0:
            subprocess.run([*pip[:3], "uninstall", "-y", "-q", "torchvision"], check=True)
        marker.write_text(wanted)
    return str(python)


def _version() -> str:
    from importlib import metadata

    return metadata.version("openvino-genai")


def _resolves(url: str) -> bool:
    import socket
    from urllib.parse import urlparse

    try:
        socket.getaddrinfo(urlparse(url).hostname, 443)
        return True
    except OSError:
        return False


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
