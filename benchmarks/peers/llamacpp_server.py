"""llama.cpp's OpenAI-compatible server (the `xllamacpp` wheel) in this process, until killed.

Run with the peers' Python: `benchmarks/.venvs/peers/bin/python benchmarks/peers/llamacpp_server.py
--port P --gguf FILE`. Standard library + xllamacpp only.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=16, help="slots (concurrent sequences)")
    parser.add_argument("--step-tokens", type=int, default=256, help="n_batch = n_ubatch")
    parser.add_argument("--ctx-per-seq", type=int, default=2048, help="context per slot")
    parser.add_argument(
        "--cache-prompt",
        action="store_true",
        help="reuse a slot's prompt prefix (+ 256 MiB host prompt cache)",
    )
    args = parser.parse_args()

    import xllamacpp  # type: ignore[import-not-found,unused-ignore]

    params = xllamacpp.CommonParams()
    params.model.path = args.gguf
    params.n_parallel = args.parallel
    params.n_ctx = args.ctx_per_seq * args.parallel  # split evenly over the slots
    params.n_batch = args.step_tokens
    params.n_ubatch = args.step_tokens
    params.cont_batching = True
    # Off by default: benchmarks repeat seeded prompts, so reuse across runs would flatter it.
    params.cache_prompt = args.cache_prompt
    params.cache_ram_mib = 256 if args.cache_prompt else 0
    params.cache_idle_slots = args.cache_prompt
    params.port = args.port
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    server = xllamacpp.Server(params)
    print(f"llama.cpp listening at {server.listening_address}", flush=True)
    while True:  # the server runs on its own threads; SIGTERM ends the process
        time.sleep(3600)


if __name__ == "__main__":
    main()
