"""jaxinfer: LLM inference on JAX/XLA — compiled bucketed shapes, paged KV cache, Pallas kernels.

Python API (names as in vLLM)::

    from jaxinfer import LLM, SamplingParams
    llm = LLM("smollm2-135m", max_model_len=2048)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)
"""

import os

# transformers (tokenizers, configs, chat templates) announces at import that PyTorch is
# absent, an advisory line jaxinfer never needs; its own switch for those lines, unless the
# user set it. (The CLI also lowers transformers' verbosity.)
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jaxinfer.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine pulls in JAX; import it lazily so `jaxinfer --help` and the plain-Python
    # parts (scheduler, allocator) stay light.
    if name == "LLM":
        from jaxinfer import llm

        return llm.LLM
    if name == "LLMEngine":
        from jaxinfer import engine

        return engine.LLMEngine
    raise AttributeError(name)
