"""The ``kvtier`` command: benchmarks, the demo, and the configuration table."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

from kvtier.cli.bench.report import print_table


def _bench_transfer(args) -> dict:
    from rich.progress import Progress

    if args.device == "cuda":
        return _bench_transfer_cuda(args)
    from kvtier.cli.bench import transfer

    with Progress(transient=True, disable=args.json) as progress:
        task = progress.add_task("bench transfer", total=args.repeats * 2 + 2)
        result = transfer.run(gib=args.gib if args.gib is not None else 1.0, repeats=args.repeats, disk_dir=args.disk_dir,
                              progress=lambda: progress.advance(task))
    if not args.json:
        print_table(f"kvtier bench transfer ({result['bytes'] / 2**30:.2f} GiB, {result['blocks']} scattered blocks)", [
            ("offload GB/s (vs memcpy)", f"{result['offload_gbps']:.2f} ({result['offload_vs_memcpy']:.2f}x)"),
            ("load GB/s (vs memcpy)", f"{result['load_gbps']:.2f} ({result['load_vs_memcpy']:.2f}x)"),
            ("memcpy GB/s", f"{result['memcpy_gbps']:.2f}"),
            ("disk write GB/s (vs file)", f"{result['disk_write_gbps']:.2f} ({result['disk_write_vs_file']:.2f}x)"),
            ("disk read GB/s (vs file)", f"{result['disk_read_gbps']:.2f} ({result['disk_read_vs_file']:.2f}x)"),
            ("plain file write / read GB/s", f"{result['file_write_gbps']:.2f} / {result['file_read_gbps']:.2f}"),
            ("key hashing, tokens/s", f"{result['hash_tokens_per_s']:.3g}"),
        ])
    return result


def _bench_transfer_cuda(args) -> dict:
    from rich.progress import Progress

    from kvtier.cli.bench import transfer_cuda

    with Progress(transient=True, disable=args.json) as progress:
        task = progress.add_task("bench transfer --device cuda", total=2 * args.repeats)
        result = transfer_cuda.run(gib=args.gib if args.gib is not None else 4.0, repeats=args.repeats,
                                   progress=lambda: progress.advance(task))
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as disk_dir:
        result.update(transfer_cuda.disk_hit(disk_dir, repeats=args.repeats))
    if not args.json:
        rows = []
        for case in ("scattered", "contiguous"):
            r = result[case]
            rows += [(f"{case}: offload GB/s (vs memcpy D2H)", f"{r['offload_gbps']:.2f} ({r['offload_vs_memcpy']:.2f}x)"),
                     (f"{case}: load GB/s (vs memcpy H2D)", f"{r['load_gbps']:.2f} ({r['load_vs_memcpy']:.2f}x)"),
                     (f"{case}: both at once GB/s (vs both memcpys)", f"{r['both_gbps']:.2f} ({r['both_vs_memcpy']:.2f}x)")]
        rows += [("host pool", f"{result['host_pool']}, {result['host_pool_huge_bytes'] >> 20} MiB on 2 MiB pages"),
                 ("memcpy D2H / H2D GB/s", f"{result['scattered']['memcpy_d2h_gbps']:.2f} / "
                                             f"{result['scattered']['memcpy_h2d_gbps']:.2f}"),
                 ("round trip byte-exact", str(result["exact"])),
                 ("store submit, host us (median / p99)", f"{result['store_submit_us_median']:.0f} / "
                                                          f"{result['store_submit_us_p99']:.0f}"),
                 ("compute stream slowdown with a store a step", f"{100 * result['compute_slowdown']:.1f}%"),
                 (f"disk hit of {result['disk_hit_bytes'] >> 20} MiB, ms (vs page-cache read + plain copy)",
                  f"{result['disk_hit_ms']:.1f} ({result['disk_hit_vs_read_plus_copy']:.2f}x)"),
                 ("its copy into the device: host hit ms (vs plain copy_ of the pinned bytes)",
                  f"{result['host_hit_ms']:.2f} ({result['host_hit_vs_plain_copy']:.2f}x)"),
                 ("page-cache read / plain copy_ ms", f"{result['page_cache_read_ms']:.1f} / {result['plain_h2d_ms']:.2f}"),
                 ("disk hit byte-exact", str(result["disk_hit_exact"]))]
        print_table(f"kvtier bench transfer --device cuda ({result['bytes'] / 2**30:.2f} GiB, {result['blocks']} "
                     f"blocks of {result['slot_bytes'] >> 20} MiB, {result['device']}, {result['mover']})", rows)
    return result


def _vllm_api(args) -> dict:
    from kvtier.integrations.vllm import api_check

    tested = api_check.VllmSource(args.tested) if args.tested or not args.json else None
    reports = {}
    for where in args.sources or [None]:
        report = api_check.check(api_check.VllmSource(where), tested)
        reports[report.version] = dataclasses.asdict(report)
        if not args.json:
            print(api_check.markdown(report, tested.version if tested else None))
    return reports


def _bench_ttft(args) -> dict:
    from kvtier.cli.bench import ttft

    return ttft.main(args)


def _doctor(args) -> dict:
    from kvtier.cli import doctor

    token_ids = json.loads(args.token_ids) if args.token_ids else None
    if args.prompt is not None:
        if not args.model:
            raise SystemExit("kvtier doctor: --prompt needs --model (its tokenizer)")
        from transformers import AutoTokenizer
        token_ids = AutoTokenizer.from_pretrained(args.model).encode(args.prompt)
    report = doctor.run(args.config, args.kv_transfer_config, args.model, args.timeout, token_ids, args.namespace,
                        json.loads(args.engine_args) if args.engine_args else None, args.node_socket)
    if not args.json:
        doctor.print_report(report)
    return report


def _bytes_flag(value: str) -> int:
    from kvtier.common.units import parse_bytes
    try:
        parsed = parse_bytes(value)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if parsed <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a byte count > 0")
    return parsed


def _positive_int(value: str) -> int:
    try:
        parsed = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if parsed <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number > 0")
    return parsed


def _serve(args) -> None:
    if args.pool != "node":
        from kvtier.cli import servers
        return servers.serve(args.pool, args.memory)
    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        raise SystemExit("kvtier serve node: --kv-events-replay-endpoint replays the events of "
                         "--kv-events-endpoint: give both")
    from kvtier.node import server
    try:
        server.serve(args.socket, args.host_bytes, page_bytes=args.page_bytes, disk_dir=args.disk_dir,
                     disk_bytes=args.disk_bytes, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                     events_endpoint=args.kv_events_endpoint, topic=args.kv_events_topic,
                     replay_endpoint=args.kv_events_replay_endpoint, buffer_batches=args.kv_events_buffer_batches)
    except (ValueError, OSError, RuntimeError) as error:  # a flag the server cannot use, a socket taken
        raise SystemExit(f"kvtier serve node: {error}") from None


def _demo(args) -> dict:
    from kvtier.cli.demo import workload

    return workload.main(args)


# The packages only the commands use, and the extra that installs each (pyproject.toml).
EXTRAS = {"rich": "tools", "aiohttp": "tools", "matplotlib": "demo", "transformers": "demo"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="benchmarks, each against a peer measured in the same run")
    benches = bench.add_subparsers(dest="bench", required=True)
    transfer = benches.add_parser("transfer", help="host pool and disk tier throughput vs memcpy and plain files")
    transfer.add_argument("--gib", type=float, default=None,
                          help="bytes of blocks to move (default 1 GiB on the CPU, 4 GiB on CUDA)")
    transfer.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                          help="cpu: host pool and disk tier (vLLM CPU layout); cuda: the CUDA copier "
                               "(FlashAttention layout, pinned host pool)")
    transfer.add_argument("--repeats", type=int, default=3)
    transfer.add_argument("--disk-dir", default=None, help="where the disk benchmark writes (default: a temp dir)")
    transfer.add_argument("--json", action="store_true", help="print the results as JSON")
    transfer.set_defaults(run=_bench_transfer)

    ttft = benches.add_parser("ttft", help="time to first token: recompute, kvtier, ExampleConnector (vLLM)")
    ttft.add_argument("--prompt-tokens", type=int, default=4096)
    ttft.add_argument("--workdir", default="kvtier-out/bench-ttft")
    ttft.add_argument("--quick", action="store_true", help="a smaller model and workload")
    ttft.add_argument("--json", action="store_true")
    ttft.set_defaults(run=_bench_ttft)

    pool = benches.add_parser("pool", help="storage pool through kvtier vs the raw client; disaggregated TTFT")
    pool.add_argument("--workdir", default="kvtier-out/bench-pool")
    pool.add_argument("--quick", action="store_true")
    pool.add_argument("--json", action="store_true")
    pool.set_defaults(run=lambda args: __import__("kvtier.cli.bench.pool", fromlist=["x"]).main(args))

    tiers = benches.add_parser("tiers", help="a hit from each tier inside vLLM vs the floor its bytes allow")
    tiers.add_argument("--workdir", default="kvtier-out/bench-tiers")
    tiers.add_argument("--tiers", default=None, help="comma-separated subset of disk,file,redis,mooncake")
    tiers.add_argument("--quick", action="store_true", help="a smaller model and fewer, shorter prompts")
    tiers.add_argument("--large", action="store_true", help="a model with 92 MiB of KV per prompt (16 layers x 1024 "
                       "wide, 8 KV heads), 3 prompts")
    tiers.add_argument("--json", action="store_true")
    tiers.set_defaults(run=lambda args: __import__("kvtier.cli.bench.tiers", fromlist=["x"]).main(args))

    node = benches.add_parser("node", help="hits through the node cache server vs embedded kvtier, another "
                                           "engine's entries and restarts")
    node.add_argument("--workdir", default="kvtier-out/bench-node")
    node.add_argument("--quick", action="store_true", help="a smaller model and fewer, shorter prompts")
    node.add_argument("--json", action="store_true")
    node.set_defaults(run=lambda args: __import__("kvtier.cli.bench.node", fromlist=["x"]).main(args))

    events = benches.add_parser("events", help="what kvtier's KV events cost the scheduler's thread per block")
    events.add_argument("--json", action="store_true")
    events.set_defaults(run=lambda args: __import__("kvtier.cli.bench.events", fromlist=["x"]).main(args))

    layerwise = benches.add_parser("layerwise", help="transfer time hidden behind compute, layer by layer")
    layerwise.add_argument("--workdir", default="kvtier-out/bench-layerwise")
    layerwise.add_argument("--quick", action="store_true")
    layerwise.add_argument("--no-engine", action="store_true", help="only the synthetic model, no vLLM")
    layerwise.add_argument("--json", action="store_true")
    layerwise.set_defaults(run=lambda args: __import__("kvtier.cli.bench.layerwise", fromlist=["x"]).main(args))

    serve = benches.add_parser("serve", help="vLLM's own client against your model: no connector, kvtier, an "
                                             "ideal device cache, each with the same CPUs")
    serve.add_argument("--model", default=None, help="a model directory or name (default: a generated 4-layer Llama)")
    serve.add_argument("--kvtier-config", default=None, help="kvtier's kv_connector_extra_config, as JSON (default: "
                                                             "a disk tier in the workdir behind an 8 MiB host pool)")
    serve.add_argument("--client-args", default=None, help="vLLM's client's dataset flags, e.g. '--dataset-name "
                                                           "random --random-input-len 1024 --num-prompts 64' "
                                                           "(default: prefix_repetition, 12 prefixes of 512 tokens)")
    serve.add_argument("--concurrency", type=int, default=4)
    serve.add_argument("--vllm-args", default=None, help="every server's vLLM flags (default: --max-model-len 2048 "
                                                         "--block-size 32 --gpu-memory-utilization 0.3)")
    serve.add_argument("--blocks", type=int, default=96, help="the device KV cache of the none and kvtier servers, "
                                                              "in blocks (0: vLLM's own sizing)")
    serve.add_argument("--no-ideal", dest="ideal", action="store_false", help="leave out the ideal device cache")
    serve.add_argument("--ideal-blocks", type=int, default=640, help="the ideal server's device KV cache, in blocks")
    serve.add_argument("--reserved-cpus", type=int, default=1,
                       help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server alike (vLLM's CPU build)")
    serve.add_argument("--layout", choices=["multiprocess", "in_process"], default="multiprocess",
                       help="vLLM's layout for every server: its default (worker in a process of its own) or "
                            "in_process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one GPU's layout)")
    serve.add_argument("--explain", action="store_true",
                       help="add where a kvtier hit's time to first token went, phase by phase (kvtier's counters)")
    serve.add_argument("--rounds", type=int, default=1,
                       help="serve the workload this many times over, the servers alternating; each figure is "
                            "the median of a server's rounds, with their spread")
    serve.add_argument("--port", type=int, default=8321)
    serve.add_argument("--workdir", default="kvtier-out/bench-serve")
    serve.add_argument("--json", action="store_true")
    serve.set_defaults(run=lambda args: __import__("kvtier.cli.bench.serve", fromlist=["x"]).main(args))

    broadcast = benches.add_parser("broadcast", help="tensor-parallel sharded broadcast vs one broadcast")
    broadcast.add_argument("--shard-blocks", type=int, default=16)
    broadcast.add_argument("--quick", action="store_true")
    broadcast.add_argument("--json", action="store_true")
    broadcast.set_defaults(run=lambda args: __import__("kvtier.cli.bench.broadcast", fromlist=["x"]).main(args))

    demo = commands.add_parser("demo", help="vLLM with kvtier on long shared prefixes: cold, warm, after restart")
    demo.add_argument("--workdir", default="kvtier-out/demo")
    demo.add_argument("--quick", action="store_true", help="a smaller model and workload")
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(run=_demo)

    serve = commands.add_parser("serve", help="run the node cache server, or a local storage pool on loopback, "
                                              "in the foreground")
    serve.add_argument("pool", choices=["node", "mooncake", "redis"])
    serve.add_argument("--memory", default="1GB",
                       help="what the pool may hold (Mooncake's storage node; Redis's maxmemory, least recently "
                            "used entries evicted beyond it)")
    serve.add_argument("--socket", default="/run/kvtier/node.sock", help="node: the Unix socket engines name in "
                       "node_socket (created owner-only)")
    serve.add_argument("--host-bytes", default="4GiB", type=_bytes_flag, help="node: the host pool every engine of the node shares")
    serve.add_argument("--page-bytes", default="64KiB", type=_bytes_flag, help="node: the pool's page; an entry takes whole pages")
    serve.add_argument("--disk-dir", default=None, help="node: the node's disk, written through (default: none)")
    serve.add_argument("--disk-bytes", default="16GiB", type=_bytes_flag, help="node: the disk's bound, least recently used deleted")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="node: Prometheus metrics on PORT (at /metrics; 0: any free port; default: none)")
    serve.add_argument("--metrics-host", default="127.0.0.1",
                       help="node: the address the metrics listen on (0.0.0.0 for a scraper in another pod)")
    serve.add_argument("--kv-events-endpoint", default=None,
                       help="node: publish the KV events of the node's blocks, once for every engine, on this ZMQ "
                            "endpoint (vLLM's format; e.g. tcp://127.0.0.1:5560; default: none)")
    serve.add_argument("--kv-events-topic", default="", help="node: the events' ZMQ topic")
    serve.add_argument("--kv-events-replay-endpoint", default=None,
                       help="node: answer replay requests (vLLM's protocol, a ZMQ ROUTER) on this endpoint, from the "
                            "last --kv-events-buffer-batches batches (default: none)")
    serve.add_argument("--kv-events-buffer-batches", type=_positive_int, default=None,
                       help="node: published batches kept for replay (default: 10,000)")
    serve.set_defaults(run=_serve)

    proxy = commands.add_parser("proxy", help="OpenAI-compatible proxy: prefill instance, then decode instance")
    proxy.add_argument("--prefill", action="append", required=True, help="prefill instance URL (repeatable)")
    proxy.add_argument("--decode", action="append", required=True, help="decode instance URL (repeatable)")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8000)
    proxy.set_defaults(run=lambda args: __import__("kvtier.cli.proxy", fromlist=["x"]).serve(
        args.prefill, args.decode, args.host, args.port))

    api = commands.add_parser("vllm-api", help="read a vLLM release (a wheel, or the installed one) and list what "
                                               "would break kvtier's connector; nothing is imported or run")
    api.add_argument("sources", nargs="*", help="vLLM wheels (pip download --no-deps vllm==X) or source folders; "
                                                "default: the installed vLLM")
    api.add_argument("--tested", default=None, help="the release to compare hooks with (default: the installed one)")
    api.add_argument("--json", action="store_true")
    api.set_defaults(run=_vllm_api)

    config = commands.add_parser("config", help="print the configuration keys")
    config.add_argument("--markdown", action="store_true")
    config.set_defaults(run=lambda args: print(__import__("kvtier.common.config", fromlist=["x"]).markdown_table()))

    doctor = commands.add_parser("doctor", help="check a configuration: every tier round-trips a block, disk_dir "
                                                "has room; exit status 1 when a tier is unusable, 2 when the "
                                                "configuration is invalid")
    doctor.add_argument("--config", default=None, help="a kvtier YAML file")
    doctor.add_argument("--kv-transfer-config", default=None,
                        help="vLLM's --kv-transfer-config JSON (its kv_connector_extra_config is read)")
    doctor.add_argument("--model", default=None, help="print the namespace fingerprint vLLM would key this model's "
                                                      "blocks with, and how it differs from the instances' records")
    doctor.add_argument("--engine-args", default=None,
                        help='with --model: vLLM engine arguments that change the namespace, as JSON, e.g. '
                             '\'{"block_size": 16, "dtype": "bfloat16", "tensor_parallel_size": 2}\'')
    doctor.add_argument("--timeout", type=float, default=20.0, help="seconds each tier's check may take")
    doctor.add_argument("--token-ids", default=None, help="a prompt as a JSON list of token ids: which tier holds "
                                                          "each of its blocks, or why none does")
    doctor.add_argument("--prompt", default=None, help="a prompt as text, tokenized with --model's tokenizer")
    doctor.add_argument("--namespace", default=None,
                        help="the namespace record a running instance wrote (default: the one --model gives, "
                             "else the only one in the tiers' directories)")
    doctor.add_argument("--node-socket", default=None, help="check this node server (kvtier serve node): a block's "
                                                             "round trip, and what it holds for which engines")
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(run=_doctor)

    args = parser.parse_args(argv)
    try:
        result = args.run(args)
    except ModuleNotFoundError as error:  # a command's own packages, which the connector does not need
        extra = EXTRAS.get(error.name)
        if extra is None:
            raise
        print(f"kvtier {args.command}: needs {error.name}, which kvtier installs with its '{extra}' extra: "
              f"pip install 'kvtier[{extra}]'", file=sys.stderr)
        return 2
    if args.command == "doctor":
        if args.json:
            json.dump(result, sys.stdout, indent=2)
            print()
        sys.stdout.flush()
        os._exit(result["status"])  # a tier check given up may still hold a thread inside its client
    if getattr(args, "json", False) and result is not None:
        json.dump(result, sys.stdout, indent=2)
        print()
    return getattr(args, "exit_status", 0)  # a benchmark that found its comparison unfair says so


if __name__ == "__main__":
    sys.exit(main())
