"""Embed token-id prompts of different lengths with vLLM's offline engine on the model directory
given as the first argument and print one JSON line: ``{"embeddings": [[...], ...],
"kvmulti_forward_calls": n, "kvmulti_file": path, "attn_types": [...]}``. Run by
tests/test_vllm_engine.py in vLLM's venv, in one process; with ``KVMULTI_VLLM=1`` kvmulti's plugin
replaces CPU_ATTN. The second argument is the block size. kvmulti and its kernel sources come from
this checkout (tests/vllm_checkout.py; ``"sources"`` in the JSON says where from)."""

from __future__ import annotations

import json
import sys

import vllm_checkout  # first: kvmulti and its kernel sources from this checkout


def main(path: str, block_size: int) -> None:
    import kvmulti
    from kvmulti.integrations.vllm.engine_run import count_kvmulti_calls, prompts
    from vllm import LLM

    counter = count_kvmulti_calls()
    llm = LLM(model=path, runner="pooling", dtype="float32", block_size=block_size,
              max_model_len=128, enforce_eager=True, seed=0, max_num_seqs=8)
    inputs = [{"prompt_token_ids": [t % 300 + 1 for t in p]} for p in prompts(6)]
    outputs = llm.embed(inputs, use_tqdm=False)
    print(json.dumps({"embeddings": [list(map(float, o.outputs.embedding)) for o in outputs],
                      "kvmulti_forward_calls": counter[0], "kvmulti_file": kvmulti.__file__,
                      "sources": vllm_checkout.sources()}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
