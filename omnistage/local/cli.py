"""The `omnistage` command: validate, explain, crd, serve, generate, run, models build / check / pull / hollow."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from omnistage.api import MODALITIES, SpecError, load_pipeline
from omnistage.contract.launch import (
    ENV_ALLOWED_HOSTS,
    ENV_API_KEYS,
    ENV_CLIENT_API_KEY,
    ENV_JOBS_STORE,
    model_root,
    report_exit,
)
from omnistage.local import gpu_placement
from omnistage.local.restarts import LOG_BACKUPS, LOG_MAX_BYTES
from omnistage.logs import ACCESS_LOGGER, ENV_ACCESS_LOG, ENV_LOG_FORMAT, log_format
from omnistage.store_url import redacted_url

DEFAULT_MODEL_DIR = str(model_root())


def _print_spec_errors(path: str, e: SpecError) -> None:
    print(f"{path}: invalid pipeline ({len(e.errors)} error{'s' if len(e.errors) != 1 else ''}):", file=sys.stderr)
    for err in e.errors:
        print(f"  {err}", file=sys.stderr)


def _print_json(doc) -> None:
    print(json.dumps(doc, indent=2))


def cmd_validate(args) -> int:
    bad, docs = 0, []
    for path in args.files:
        try:
            p = load_pipeline(path)
        except SpecError as e:
            bad += 1
            if args.output == "json":
                docs.append({"file": path, "valid": False,
                             "errors": [{"path": err.path, "message": err.message} for err in e.errors]})
            else:
                _print_spec_errors(path, e)
            continue
        order = [s.name for s in p.topo_order()]
        if args.output == "json":
            docs.append({"file": path, "valid": True, "pipeline": p.name, "stages": order,
                         "outputs": [{"modality": o.modality, "stage": o.stage} for o in p.outputs], "errors": []})
            continue
        print(f"{path}: ok (pipeline {p.name}: {' -> '.join(order)}; outputs "
              f"{', '.join(f'{o.modality} from {o.stage}' for o in p.outputs)})")
    if args.output == "json":
        _print_json(docs)
    return 1 if bad else 0


def cmd_explain(args) -> int:
    from omnistage.api.explain import UnknownField, explain, explain_doc

    try:
        if args.output == "json":
            _print_json(explain_doc(args.path, recursive=args.recursive))
        else:
            print(explain(args.path, recursive=args.recursive), end="")
    except UnknownField as e:
        print(f"omnistage explain: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_crd(args) -> int:
    from omnistage.api.crd import crd_yaml

    text = crd_yaml()
    if not args.output:
        print(text, end="")
    for path in args.output or ():
        Path(path).write_text(text)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _launcher(args, **options):
    """The local pipeline of a serve or run (`options`: LocalPipeline's own); exits 2 before any process
    starts when a stage's model fails the same check as `omnistage models check`."""
    from omnistage.checkpoints.check import check_pipeline
    from omnistage.local.serve import LocalPipeline

    pipeline = load_pipeline(args.file)
    _, errors = check_pipeline(pipeline, args.models)
    for e in errors:
        print(f"omnistage {args.command}: {args.file}: {e}", file=sys.stderr)
    if errors:
        raise SystemExit(2)
    replicas = {}
    for item in args.replicas or []:
        name, _, n = item.partition("=")
        if name not in {s.name for s in pipeline.stages} or not n.isdigit() or int(n) < 1:
            raise SystemExit(f'--replicas "{item}": expected STAGE=N with a stage of {pipeline.name} and N >= 1')
        replicas[name] = int(n)
    log_env = {ENV_LOG_FORMAT: args.log_format} if args.log_format else {}   # else the environment's, or text
    if args.no_access_log:
        log_env[ENV_ACCESS_LOG] = "off"
    return LocalPipeline(Path(args.file).resolve(), pipeline, Path(args.models).resolve(), host=args.host,
                         port=args.port, log_dir=args.log_dir, replicas=replicas, extra_env=log_env,
                         log_max_bytes=args.log_max_bytes, log_backups=args.log_backups, **options)


def _print_endpoints(local) -> None:
    """Where a user reaches the served pipeline: both client APIs, each process's status port, and the
    file one Prometheus scrape config reads them from."""
    from omnistage.contract.launch import LIVE_PATH, METRICS_PATH, READY_PATH

    tls_ca = " --tls-ca CA_FILE" if local.client_tls_dir else ""
    print(f"  gRPC:       {local.endpoint}    (try: omnistage generate --endpoint {local.endpoint}{tls_ca} "
          "--prompt 'Hello')")
    if local.api_url:
        print(f"  OpenAI API: {local.api_url}")
    width = max(len(name) for name in local.status_urls)
    for name, url in local.status_urls.items():
        print(f"  {name:<{width}}  {url}{METRICS_PATH}  {url}{READY_PATH}  {url}{LIVE_PATH}")
    if local.jobs is not None:
        print(f"  Job store:  {redacted_url(local.jobs.store)}  (content in {local.jobs.content})")
    print(f"  Prometheus targets (file_sd_configs): {local.targets_file}", flush=True)


def _hops_line(local) -> str:
    """What protects the calls between the orchestrator and the stages (and what the client ports serve)."""
    client = "TLS" if local.client_tls_dir else f"plaintext on {local.host}"
    if local.tls:
        return (f"internal hops (orchestrator -> stages): mTLS, certificates from a throwaway CA deleted at exit; "
                f"client ports: {client}")
    return f"internal hops (orchestrator -> stages): PLAINTEXT, unauthenticated (--no-tls); client ports: {client}"


def cmd_serve(args) -> int:
    from omnistage.local.serve import LaunchError

    if args.allowed_host:  # the orchestrator reads it where it builds the API; the processes inherit it
        os.environ[ENV_ALLOWED_HOSTS] = ",".join(args.allowed_host)
    try:
        local = _launcher(args, api_port=args.api_port, api_keys=args.api_key, tls=not args.no_tls,
                          client_tls_dir=Path(args.client_tls_dir).resolve() if args.client_tls_dir else None,
                          jobs_store=args.jobs_store or os.environ.get(ENV_JOBS_STORE) or None,
                          jobs_content=Path(args.jobs_content).resolve() if args.jobs_content else None)
        if args.no_api or not local.pipeline.deployment.orchestrator.http.enabled:
            local.api_port = None
    except SpecError as e:
        _print_spec_errors(args.file, e)
        return 2
    stop = {"sig": None}

    def on_signal(signum, frame):
        stop["sig"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    try:
        endpoint = local.start()
    except LaunchError as e:
        print(f"omnistage serve: {e}", file=sys.stderr)
        local.stop()
        return 1
    print(f"pipeline {local.pipeline.name} serving on {endpoint} (cold start {time.monotonic() - t0:.1f}s)")
    print(f"  {_hops_line(local)}")
    _print_endpoints(local)
    autoscaler = _autoscaler(local) if args.autoscale or local.pipeline.deployment.autoscaling.enabled else None
    try:
        while stop["sig"] is None:
            if autoscaler is not None:
                autoscaler.tick()
            for event in local.supervise():   # a process that died is restarted, with backoff; one line each
                print(f"omnistage serve: {event}", file=sys.stderr, flush=True)
            time.sleep(0.2)
    finally:
        print("stopping ...", flush=True)
        if autoscaler is not None:
            autoscaler.close()
        local.stop()
    return 0


def _autoscaler(local):
    from omnistage.local.autoscale import LocalAutoscaler

    a = local.pipeline.deployment.autoscaling
    auto = LocalAutoscaler(local)
    bounds = ", ".join(f"{s} {a.bounds(s).min_replicas}-{a.bounds(s).max_replicas}" for s in auto.planner.bounds)
    print(f"  planner: every {a.interval_seconds:g}s, utilisation target {a.targets.utilization:g}, queue target "
          f"{a.targets.queue_seconds:g}s, replicas {bounds}; decisions at {auto.metrics_url}", flush=True)
    if auto.fixed:
        print(f"  planner: {', '.join(sorted(auto.fixed))} on GPUs: kept at the replicas they started with", flush=True)
    return auto


def _gen_kwargs(args) -> dict:
    """The request's keyword arguments for OmniClient.generate; ValueError says what is wrong with them."""
    kw = dict(system_prompt=args.system_prompt, raw_prompt=args.raw_prompt, max_tokens=args.max_tokens,
              seed=args.seed, max_codec_frames=args.max_codec_frames, width=args.width, height=args.height,
              num_inference_steps=args.num_inference_steps, outputs=args.output or (),
              return_trace=args.return_trace, ignore_eos=args.ignore_eos, priority=args.priority,
              request_id=args.request_id)
    if args.temperature is not None:
        kw["temperature"] = args.temperature
    if args.media:  # the prompt is the last part, after the media in command-line order
        kw["parts"] = [_media_part(kind, path, args.video_fps) for kind, path in args.media]
        kw["parts"] += [args.prompt] if args.prompt else []
    elif not args.prompt:
        raise ValueError("--prompt is required (or --image, --audio or --video)")
    else:
        kw["prompt"] = args.prompt
    return kw


def _media_part(kind: str, path: str, fps: float):
    from omnistage import client

    try:
        if kind == "image":
            return client.image_part(path)
        if kind == "audio":
            return client.audio_part(path)
        if not Path(path).is_dir():
            return client.video_file_part(path)
        if not fps > 0:
            raise ValueError(f"--video-fps must be > 0, got {fps}")
        frames = sorted(f for f in Path(path).iterdir() if f.is_file() and not f.name.startswith("."))
        if not frames:
            raise ValueError(f"--video {path}: the folder has no frame files")
        return client.video_part(frames, [j / fps for j in range(len(frames))])
    except OSError as e:
        raise ValueError(f"--{kind} {path}: cannot read it ({e.strerror or e})") from None


class _AppendMedia(argparse.Action):
    """--image, --audio and --video FILE into one list of (kind, path), in command-line order."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), (self.const, values)])


def _print_result(result, out: str | None, trace: bool) -> None:
    if result.text:
        print(result.text)
    if result.pcm:
        path = out if out and out.endswith(".wav") else "out.wav"
        result.save_audio(path)
        print(f"audio: {result.audio_seconds:.2f}s at {result.sample_rate} Hz in {result.audio_chunks} chunks "
              f"-> {path}")
    for i, img in enumerate(result.images):
        path = out if out and out.endswith(".png") and i == 0 else f"out-{i}.png"
        result.save_image(path, i)
        print(f"image: {img.width}x{img.height} -> {path}")
    if result.final is not None:
        u = result.final.usage
        print(f"finish: {result.final.finish_reason}; prompt tokens {u.prompt_tokens}, completion tokens "
              f"{u.completion_tokens}; first event after {1e3 * (result.first_event_s or 0):.0f} ms")
        if trace and result.final.HasField("trace"):
            t = result.final.trace
            if t.media_decode_ms:
                print(f"media decode: {t.media_decode_ms:.1f} ms (orchestrator admission check)")
            for s in t.stages:
                if s.encode_ms:
                    print(f"media encode: {s.encode_ms:.1f} ms in stage {s.stage}")
            print(f"trace: admission {t.admission_wait_ms:.1f} ms, first output {t.first_output_ms:.1f} ms, "
                  f"total {t.total_ms:.1f} ms")
            print(f"  {'stage':<14}{'replica':<18}{'queue':>8}{'compute':>9}{'transfer':>9}{'first':>8}"
                  f"{'total':>8}{'chunks':>7}")
            for s in t.stages:
                print(f"  {s.stage:<14}{s.replica:<18}{s.queue_ms:>8.1f}{s.compute_ms:>9.1f}{s.transfer_ms:>9.1f}"
                      f"{s.first_chunk_ms:>8.1f}{s.total_ms:>8.1f}{s.chunks:>7}")


def cmd_generate(args) -> int:
    import grpc

    from omnistage.client import OmniClient

    try:
        kw = _gen_kwargs(args)
        with OmniClient(args.endpoint, tls_ca=args.tls_ca, api_key=args.api_key) as client:
            result = client.generate(timeout=args.timeout, **kw)
    except grpc.RpcError as e:
        print(f"omnistage generate: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"omnistage generate: {e}", file=sys.stderr)
        return 2
    _print_result(result, args.out, args.return_trace)
    return 0


def cmd_run(args) -> int:
    """Serve a pipeline, answer one request, stop: the quickest way to see a pipeline work."""
    import grpc

    from omnistage.client import OmniClient
    from omnistage.local.serve import LaunchError

    try:
        kw = _gen_kwargs(args)
        local = _launcher(args)
    except SpecError as e:
        _print_spec_errors(args.file, e)
        return 2
    except ValueError as e:
        print(f"omnistage run: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        endpoint = local.start()
        print(f"pipeline {local.pipeline.name} serving on {endpoint} (cold start {time.monotonic() - t0:.1f}s)",
              flush=True)
        with OmniClient(endpoint) as client:
            result = client.generate(timeout=args.timeout, **kw)
        _print_result(result, args.out, args.return_trace)
        return 0
    except LaunchError as e:
        print(f"omnistage run: {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        print(f"omnistage run: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        local.stop()


def cmd_models_build(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _quiet_model_libraries()
    from omnistage.tiny_models import MODELS, build_models

    names = args.only or None
    try:
        print(f"building tiny models in {args.dir}:", flush=True)
        build_models(args.dir, names, force=args.force, progress=lambda m: print(m, flush=True))
    except KeyError as e:
        print(f"omnistage models build: {e.args[0]} (known: {', '.join(MODELS)})", file=sys.stderr)
        return 2
    return 0


def _pipeline_with_stage(args, command: str):
    """The pipeline of `omnistage models COMMAND FILE [--stage NAME]`, or None once its errors are said (a
    stage it does not have is said as a termination message: the operator's init containers name one)."""
    try:
        pipeline = load_pipeline(args.file)
    except SpecError as e:
        _print_spec_errors(args.file, e)
        return None
    if args.stage is not None and args.stage not in {s.name for s in pipeline.stages}:
        report_exit(f"omnistage models {command}: {args.file} has no stage {args.stage!r}")
        return None
    return pipeline


def cmd_models_check(args) -> int:
    from omnistage.checkpoints.check import check_pipeline, describe

    pipeline = _pipeline_with_stage(args, "check")
    if pipeline is None:
        return 2
    if args.annotate and not args.plan:
        print("omnistage models check: --annotate goes with --plan", file=sys.stderr)
        return 2
    if args.plan and args.output == "json":
        print("omnistage models check: -o json is not given with --plan (its table is text)", file=sys.stderr)
        return 2
    if args.plan:
        return _print_memory_plans(args.file, pipeline, args.models, args.gpu_memory, args.annotate)
    plans, errors = check_pipeline(pipeline, args.models, only=args.stage)
    if args.output == "json":
        _print_json({"file": args.file, "ok": not errors, "stages": [
            {"stage": p.stage, "family": p.family, "directory": str(p.directory), "device": p.device,
             "weight_bytes": p.weight_bytes, "weights": [{"file": f, "bytes": n} for f, n in p.weights],
             "other_files": list(p.other_files)} for p in plans],
            "errors": [{"field": e.field, "stage": e.stage, "message": e.message} for e in errors]})
        return 2 if errors else 0
    if plans:
        print(describe(plans))
    for err in errors:
        if args.stage:   # one stage checked (the operator's init container): the container's termination message
            report_exit(f"{args.file}: {err}")
        else:
            print(f"{args.file}: {err}", file=sys.stderr)
    return 2 if errors else 0


def cmd_models_pull(args) -> int:
    from omnistage.checkpoints.pull import PullError, hub_stages, pull_pipeline

    pipeline = _pipeline_with_stage(args, "pull")
    if pipeline is None:
        return 2
    if not hub_stages(pipeline, args.stage):
        print(f"{args.file}: no hf:// model to pull" + (f" for stage {args.stage}" if args.stage else ""))
        return 0
    try:
        for p in pull_pipeline(pipeline, args.models, args.stage, progress=lambda m: print(m, flush=True)):
            print(f"{p.stage}: {p.source}: {p.files} files, {p.bytes} bytes in {p.directory}", flush=True)
    except PullError as e:
        report_exit(f"omnistage models pull: {args.file}: {e}")
        return 2
    return 0


def _print_memory_plans(file: str, pipeline, models: str, gpu_memory: str | None, annotate: bool) -> int:
    """The plan's table (on stderr with --annotate, whose stdout is the annotated pipeline document)."""
    import copy

    import yaml

    from omnistage.api.memory_plan import annotate as with_plan
    from omnistage.api.memory_plan import parse_bytes
    from omnistage.checkpoints.fit import misfit
    from omnistage.checkpoints.plan import describe_plans, plan_pipeline

    try:
        gpu_bytes = None if gpu_memory is None else parse_bytes(gpu_memory)
    except ValueError as e:
        print(f"omnistage models check: --gpu-memory {e}", file=sys.stderr)
        return 2
    plans, errors = plan_pipeline(pipeline, models)
    if plans:
        print(describe_plans(plans), file=sys.stderr if annotate else sys.stdout)
    deployments = pipeline.deployment.stages
    errors += filter(None, (misfit(p, pipeline.stage(p.stage), deployments[p.stage], gpu_bytes) for p in plans))
    for e in errors:
        print(f"{file}: {e}", file=sys.stderr)
    if annotate and not errors:
        doc = with_plan(copy.deepcopy(dict(pipeline.raw)), {p.stage: p.total_bytes for p in plans})
        print(yaml.safe_dump(doc, sort_keys=False), end="")
    return 2 if errors else 0


def cmd_models_hollow(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _quiet_model_libraries()
    from omnistage.checkpoints.hollow import PUBLISHED_MODELS, write_hollow

    if args.family not in PUBLISHED_MODELS:
        print(f"omnistage models hollow: no published layout for {args.family!r} "
              f"(known: {', '.join(PUBLISHED_MODELS)})", file=sys.stderr)
        return 2
    h = write_hollow(args.family, args.dir)
    print(f"{PUBLISHED_MODELS[args.family].repo}: {h.tensors} tensors, {h.nbytes / 2**30:.1f} GiB in "
          f"{len(h.files)} sparse shard{'s' * (len(h.files) != 1)} (no data written) in {h.directory}")
    return 0


def _quiet_model_libraries() -> None:
    import logging
    import warnings

    from omnistage.serving import QUIET_AT_IMPORT

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    for name in QUIET_AT_IMPORT:
        logging.getLogger(name).setLevel(logging.ERROR)


def _add_gen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="", help="the request's text; with media, the last part after them")
    for kind, what in (("image", "a PNG, JPEG or WebP file"), ("audio", "a WAV, FLAC, MP3 or OGG file"),
                       ("video", "a folder of frame images, sorted by name, or a video file")):
        p.add_argument(f"--{kind}", dest="media", action=_AppendMedia, const=kind, metavar="FILE",
                       help=f"{what}, sent as one part; repeat: parts keep the command-line order")
    p.add_argument("--video-fps", type=float, default=2.0, help="frames per second of a --video folder")
    p.add_argument("--system-prompt", default="", help="a system turn before the prompt (chat models)")
    p.add_argument("--raw-prompt", action="store_true", help="send the prompt as written: no chat template")
    p.add_argument("--out", default=None, help="where to write the audio (.wav) or image (.png)")
    p.add_argument("--max-tokens", type=int, default=0, help="text tokens (0: pipeline default)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: greedy)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--max-codec-frames", type=int, default=0, help="audio codec frames (0: pipeline default)")
    p.add_argument("--width", type=int, default=0)
    p.add_argument("--height", type=int, default=0)
    p.add_argument("--num-inference-steps", type=int, default=0, help="diffusion steps (0: pipeline default)")
    p.add_argument("--output", action="append", choices=MODALITIES,
                   help="only these outputs (repeat; default: all of the pipeline's)")
    p.add_argument("--return-trace", action="store_true", help="ask for the per-stage trace and print it")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--priority", type=int, default=0,
                   help="higher is served first under load (above the pipeline's maxPriority: a key that allows it)")
    p.add_argument("--request-id", default="", metavar="LABEL",
                   help="your label for the request (the server assigns its own id; the label is echoed and traced)")


def _api_key_file(path: str) -> list[str]:
    """--api-key-file: the entries of FILE, one a line; blank lines and # comments skipped."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of at least 1")
    return int(value)


def _count(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of at least 0")
    return int(value)


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="OmniPipeline YAML file")
    p.add_argument("--models", default=DEFAULT_MODEL_DIR, help="model store root (default: ./models)")
    p.add_argument("--host", default="127.0.0.1", help="loopback address to bind")
    p.add_argument("--port", type=int, default=0, help="orchestrator port (0: any free port)")
    p.add_argument("--log-dir", default=None, help="where each process writes its log")
    p.add_argument("--log-format", type=log_format, default=None, metavar="json|text",
                   help=f"each process's log lines: json (one object a line) or text (default ${ENV_LOG_FORMAT} or "
                        "text)")
    p.add_argument("--no-access-log", action="store_true",
                   help=f"no {ACCESS_LOGGER} lines (one per request at the orchestrator, one per stage call)")
    p.add_argument("--log-max-bytes", type=_positive_int, default=LOG_MAX_BYTES, metavar="BYTES",
                   help=f"rotate a process's log file once it passes this (default {LOG_MAX_BYTES >> 20} MiB)")
    p.add_argument("--log-backups", type=_count, default=LOG_BACKUPS, metavar="N",
                   help=f"old copies of each log file kept by the rotation: FILE.1 (newest) to FILE.N "
                        f"(default {LOG_BACKUPS})")
    p.add_argument("--replicas", action="append", metavar="STAGE=N", help="override a stage's replica count")


def _add_output_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", choices=("text", "json"), default="text",
                   help="text (default) or json: one JSON document on stdout, for scripts")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("omnistage")
    except PackageNotFoundError:   # a checkout run without installing it
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description=__doc__)
    parser.add_argument("--version", action="version", version=f"omnistage {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check OmniPipeline files; every error with its field path")
    p.add_argument("files", nargs="+")
    _add_output_arg(p)
    p.set_defaults(fn=cmd_validate)
    p = sub.add_parser("explain", help="the fields of the OmniPipeline API at a path (like kubectl explain)")
    p.add_argument("path", nargs="?", default="", help="e.g. spec.deployment.stages (default: the whole object)")
    p.add_argument("--recursive", action="store_true", help="every field below the path, names and types only")
    _add_output_arg(p)
    p.set_defaults(fn=cmd_explain)
    p = sub.add_parser("crd", help="print the OmniPipeline CustomResourceDefinition generated from the API model")
    p.add_argument("-o", "--output", action="append", help="write it to this file instead (repeat for copies)")
    p.set_defaults(fn=cmd_crd)
    p = sub.add_parser("serve", help="run every stage and the orchestrator as local processes",
                       description="Run every stage replica and the orchestrator as local processes. Each stage "
                                   "replica gets its GPUs (CUDA_VISIBLE_DEVICES) from the machine's: those in "
                                   "$CUDA_VISIBLE_DEVICES when set, else those `nvidia-smi -L` lists "
                                   f"(${gpu_placement.ENV_GPUS}=N overrides); a file that asks for more is "
                                   "refused before anything starts.")
    _add_launch_args(p)
    p.add_argument("--api-port", type=int, default=0, help="port of the OpenAI-compatible API (0: any free port)")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="a domain name the OpenAI API accepts in a request's Host besides localhost when bound to "
                        f"loopback, e.g. a local reverse proxy's (repeatable; sets ${ENV_ALLOWED_HOSTS})")
    p.add_argument("--no-api", action="store_true",
                   help="serve the gRPC API only (as spec.deployment.orchestrator.http.enabled: false does)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY[:N]",
                   help=f"a bearer key both client APIs (gRPC and OpenAI) require; KEY:N also allows priority up to N "
                        f"(a key holds no ':'; repeat; default: ${ENV_API_KEYS}, comma-separated; none: no key "
                        "needed). The process list shows it: prefer --api-key-file or the environment")
    p.add_argument("--api-key-file", dest="api_key", action="extend", type=_api_key_file, metavar="FILE",
                   help="API keys as --api-key takes them, one a line (blank lines and lines starting with # "
                        "skipped); unlike --api-key, never shown in the process list")
    p.add_argument("--no-tls", action="store_true",
                   help="plaintext, unauthenticated calls between the orchestrator and the stages (default: "
                        "mutual TLS with a throwaway CA made at start); for benchmarks that compare")
    p.add_argument("--client-tls-dir", default=None, metavar="DIR",
                   help="serve the client-facing gRPC and OpenAI API ports over TLS with DIR/tls.crt and "
                        "DIR/tls.key (default: plaintext on the loopback address)")
    p.add_argument("--jobs-store", default=None, metavar="URL",
                   help="the durable job store (/v1/videos): sqlite:///FILE or postgresql://USER:PASS@HOST/DB "
                        f"(default ${ENV_JOBS_STORE}, else the file's jobs.store.url, else for a pipeline with a "
                        "video output SQLite in ./.omnistage/jobs/; none: jobs are refused). The process list "
                        f"shows it: prefer ${ENV_JOBS_STORE} for a password")
    p.add_argument("--jobs-content", default=None, metavar="DIR",
                   help="where finished jobs' videos and thumbnails are kept (default ./.omnistage/jobs/content)")
    p.add_argument("--autoscale", action="store_true",
                   help="run the stage planner: add and drain CPU stage replicas as measured load asks, within "
                        "spec.deployment.autoscaling (targets, budget, per-stage bounds; see docs/planner.md); "
                        "on by itself when the file sets spec.deployment.autoscaling.enabled")
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("generate", help="send one request to an orchestrator")
    p.add_argument("--endpoint", required=True,
                   help="orchestrator HOST:PORT; several replicas as IP:PORT,IP:PORT, or a gRPC target "
                        "(dns:///NAME:PORT)")
    p.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="the orchestrator serves TLS: FILE is the CA certificate (PEM) that signed its certificate")
    p.add_argument("--api-key", default=os.environ.get(ENV_CLIENT_API_KEY), metavar="KEY",
                   help=f"the orchestrator requires API keys: send KEY (default ${ENV_CLIENT_API_KEY})")
    _add_gen_args(p)
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("run", help="serve a pipeline locally, answer one request, stop")
    _add_launch_args(p)
    _add_gen_args(p)
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("models", help="build the tiny models; check a pipeline's models before serving")
    msub = p.add_subparsers(dest="models_command", required=True)
    b = msub.add_parser("build", help="build the seeded tiny models the examples use")
    b.add_argument("dir", nargs="?", default=DEFAULT_MODEL_DIR)
    b.add_argument("--only", action="append", help="build only this model (repeat)")
    b.add_argument("--force", action="store_true", help="rebuild even when up to date")
    b.set_defaults(fn=cmd_models_build)
    c = msub.add_parser("check", help="what each stage of a pipeline will load (files, bytes, device), or why not")
    c.add_argument("file", help="OmniPipeline YAML file")
    c.add_argument("--models", default=DEFAULT_MODEL_DIR, help="model store root (default: ./models)")
    _add_output_arg(c)
    c.add_argument("--plan", action="store_true", help="print each stage's memory plan (weights in its dtype, "
                                                       "KV cache at its context and batch, activations), GiB; "
                                                       "refuse a stage that does not fit its GPUs or memory limit")
    c.add_argument("--annotate", action="store_true", help="with --plan: print the pipeline with its plan in the "
                                                           "omnistage.io/memory-plan annotation (the operator "
                                                           "requests memory by it; validation refuses a memory "
                                                           "limit below it); the table goes to stderr")
    c.add_argument("--gpu-memory", metavar="SIZE", help="with --plan: the memory of one GPU the stages run on "
                                                        "(80Gi, 80GiB, 141GB); without it GPU stages are not "
                                                        "checked")
    c.add_argument("--stage", help="check this stage only; its refusal is also the termination message")
    c.set_defaults(fn=cmd_models_check)
    u = msub.add_parser("pull", help="pull a pipeline's hf:// models from the Hub (HF_ENDPOINT, HF_TOKEN) into "
                                     "the hub cache, where serve, run and the stages read them")
    u.add_argument("file", help="OmniPipeline YAML file")
    u.add_argument("--models", default=DEFAULT_MODEL_DIR, help="model store root; the cache is its hub/ folder "
                                                               "unless $OMNISTAGE_HUB_CACHE names one "
                                                               "(default: ./models)")
    u.add_argument("--stage", help="pull this stage's model only")
    u.set_defaults(fn=cmd_models_pull)
    h = msub.add_parser("hollow", help="write a real model's published layout: configs, real safetensors headers, "
                                       "sparse shards with no data (for checks without the download)")
    h.add_argument("family", help="qwen3_omni, qwen2_5_omni or sd3")
    h.add_argument("dir", help="the checkpoint directory to write")
    h.set_defaults(fn=cmd_models_hollow)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
