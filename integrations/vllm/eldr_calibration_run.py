#!/usr/bin/env python3
"""The calibration run: drives an offline vLLM instance over a sample of your prompts and writes the
ELDR capture file that eldr-calibrate reads (docs/calibration.md, "The calibration run").

Per prompt it records, like the reference implementation's offline calibration pass: the prompt's
expert counts, its gate-probability sums, and the expert counts of its first N generated tokens
(--decode_tokens, default 128), with greedy decoding and no prefix cache.

    ELDR_CAPTURE_LIBRARY=build/lib/libeldr_capture.so PYTHONPATH=integrations/vllm \\
    python3 integrations/vllm/eldr_calibration_run.py --model deepseek-ai/DeepSeek-V2-Lite \\
        --prompts prompts.jsonl --sample 2000 --decode_tokens 128 --out calibration.cap
    build/bin/eldr-calibrate --captures calibration.cap --clusters 8 --workers d0,...,d7 \\
        --out centroids.json --report report.json

--prompts: a JSON-lines file with a "prompt" string per line (and optionally a label field named by
--label_field, e.g. the domain, stored as the record's label), or a text file of one prompt per line.

How it runs vLLM (vLLM's V1 engine, 0.2x line; not testable where this project is built, so the
vLLM-facing part is kept small): LLM(model, enforce_eager=True, enable_prefix_caching=False,
max_num_seqs=1) in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, tensor parallel size 1), so
that every forward pass holds one request and the MoE hooks run here. Each MoE layer's router
(.router of the modules in compilation_config.static_forward_context, as eldr_vllm finds them)
gets its select_experts(hidden_states, router_logits) wrapped, which returns (topk_weights,
topk_ids): the ids and, by --gate_mode, the router logits (all, the default: softmax over all
experts, the reference's gate_prob_all) or the top-k weights (topk) are copied to the host and
recorded into a CPU capture context in direct mode (eldr_calibration.CalibrationRecorder).
A request runs with max_tokens = N + 1, so that its first N generated tokens each pass through a
decode forward pass (the first comes out of the prompt's pass). Slow next to serving (one request
at a time, a host copy per layer) but exact, and a calibration sample is small.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from eldr_calibration import DEFAULT_DECODE_TOKENS, CalibrationRecorder  # noqa: E402
from eldr_capture import CaptureContext, load_library  # noqa: E402


def read_prompts(path: str, label_field: str) -> list:
    """[(prompt text, label name or None)] from a JSON-lines or plain text file."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                item = json.loads(line)
                if "prompt" not in item:
                    raise SystemExit(f"{path}:{number}: no \"prompt\" key")
                label = item.get(label_field) if label_field else None
                prompts.append((str(item["prompt"]), None if label is None else str(label)))
            else:
                prompts.append((line, None))
    return prompts


def hook_moe_layers(llm, recorder: CalibrationRecorder, on_pass) -> tuple:
    """Wraps every MoE router's select_experts; returns (layers, experts, top_k). The hook records
    the ids with the router_logits argument (recorder.gate_mode "all") or the returned top-k
    weights ("topk")."""
    from eldr_vllm import find_moe_modules, router_logits_argument  # noqa: PLC0415

    config = llm.llm_engine.vllm_config
    modules = find_moe_modules(config.compilation_config.static_forward_context.values())
    if not modules:
        raise SystemExit("no MoE layer with a capturable router in this model")
    first = modules[0].layer_id
    for index, module in enumerate(modules):
        router = module.router
        original = router.select_experts

        def wrapped(*args, _original=original, _index=index, _first=(module.layer_id == first),
                    **kwargs):
            result = _original(*args, **kwargs)
            weights, ids = result[0], result[1]
            if _first:
                on_pass(int(ids.shape[0]))
            if recorder.gate_mode == "all":  # select_experts(hidden_states, router_logits, ...)
                recorder.record(_index, ids, router_logits=router_logits_argument(args, kwargs))
            else:
                recorder.record(_index, ids, weights)
            return result

        router.select_experts = wrapped
    return len(modules), int(modules[0].global_num_experts), int(modules[0].router.top_k)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the served MoE model (as for vllm serve)")
    parser.add_argument("--prompts", required=True, help="JSON lines with \"prompt\", or text lines")
    parser.add_argument("--out", required=True, help="the capture file to write")
    parser.add_argument("--sample", type=int, default=2000,
                        help="prompts to run, drawn at random (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample")
    parser.add_argument("--decode_tokens", type=int, default=DEFAULT_DECODE_TOKENS,
                        help="generated tokens whose experts make a request's decode counts")
    parser.add_argument("--gate_mode", choices=("all", "topk"), default="all",
                        help="gate sums: all = softmax over all experts of the router logits (the "
                             "reference's gate_prob_all), topk = the router's top-k weights; serve "
                             "the artifact with the same ELDR_GATE_PROBS mode")
    parser.add_argument("--label_field", default="",
                        help="JSON key of each prompt's label (e.g. domain); stored in the file")
    parser.add_argument("--max_model_len", type=int, default=0, help="passed to vLLM (0: default)")
    parser.add_argument("--dtype", default="auto", help="passed to vLLM")
    parser.add_argument("--trust_remote_code", action="store_true")
    args = parser.parse_args()

    prompts = read_prompts(args.prompts, args.label_field)
    if args.sample and len(prompts) > args.sample:
        prompts = random.Random(args.seed).sample(prompts, args.sample)
    label_names = sorted({label for _, label in prompts if label is not None})
    label_ids = {name: i for i, name in enumerate(label_names)}

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # hooks must run in this process
    from vllm import LLM, SamplingParams  # noqa: PLC0415

    engine_args = dict(model=args.model, enforce_eager=True, enable_prefix_caching=False,
                       max_num_seqs=1, tensor_parallel_size=1, dtype=args.dtype,
                       trust_remote_code=args.trust_remote_code)
    if args.max_model_len:
        engine_args["max_model_len"] = args.max_model_len
    llm = LLM(**engine_args)
    tokenizer = llm.get_tokenizer()

    state = {"key": None}
    recorder_holder = {}

    def on_pass(tokens: int) -> None:
        recorder_holder["recorder"].set_batch([(state["key"], tokens)])

    # The geometry comes from the model's MoE modules.
    from eldr_vllm import find_moe_modules  # noqa: PLC0415

    modules = find_moe_modules(
        llm.llm_engine.vllm_config.compilation_config.static_forward_context.values())
    if not modules:
        raise SystemExit("no MoE layer with a capturable router in this model")
    layers, experts = len(modules), int(modules[0].global_num_experts)
    top_k = int(modules[0].router.top_k)
    capture = CaptureContext(layers, experts, library=load_library(), max_top_k=top_k,
                             max_direct_requests=2, max_finish_requests=2, record_gate_probs=1)
    recorder = CalibrationRecorder(capture, decode_tokens=args.decode_tokens,
                                   gate_mode=args.gate_mode)
    recorder_holder["recorder"] = recorder
    hook_moe_layers(llm, recorder, on_pass)
    print(f"calibration run: {len(prompts)} prompts, {layers} MoE layers x {experts} experts, "
          f"top-{top_k}, decode counts over {args.decode_tokens} generated tokens, gate sums "
          f"{args.gate_mode}", file=sys.stderr)

    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens + 1)
    started = time.monotonic()
    for number, (prompt, label) in enumerate(prompts):
        token_ids = tokenizer.encode(prompt)
        key = f"calib-{number}"
        recorder.begin_request(key, len(token_ids), None if label is None else label_ids[label])
        state["key"] = key
        llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)
        state["key"] = None
        record = recorder.finish_request(key)
        if number % 50 == 0:
            print(f"  {number + 1}/{len(prompts)}: {record.prompt_tokens} prompt tokens, "
                  f"{record.decode_tokens} decode tokens, {time.monotonic() - started:.0f} s",
                  file=sys.stderr)
    written = recorder.write(args.out)
    print(f"wrote {written} requests to {args.out}", file=sys.stderr)
    if label_names:
        print("labels: " + ", ".join(f"{i}={name}" for i, name in enumerate(label_names)),
              file=sys.stderr)
    print(f"next: eldr-calibrate --captures {args.out} --clusters K --out centroids.json "
          f"--report report.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
