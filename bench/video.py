"""Text to video on the tiny Wan model: the staged pipeline against diffusers' `WanPipeline`, and the job API.

Sides of `video.staged_over_pipeline.frames_per_s_c4`, all up at once (each idle while another is measured):
- staged: `examples/wan-t2v-tiny.yaml` as `omnistage serve` runs it (LocalPipeline: text-encoder, denoise and
  vae-decode processes, one torch thread each, mutual TLS, the orchestrator with its OpenAI API port and the
  default SQLite job store), the pipeline's jobs.concurrency raised to 4 (from 2) so the 4 jobs run at once.
  4 jobs are POSTed to /v1/videos at once and each GET /v1/videos/{id} is polled until completed; a job's
  work includes muxing its frames to H.264 MP4 with a thumbnail and a spritesheet;
- staged_vae_x2: the same with two vae-decode replicas (`omnistage serve --replicas vae-decode=2`);
- staged_vae_shared: the same with `engineArgs.batch_invariant: false` on vae-decode (a step decodes a latent
  frame of the 4 jobs in one call either way; invariant, a lone request's convolutions and attention are padded
  to a batch of 2 so its frames are the same alone as in any batch, `video_vae.batch_invariant_decode`; off,
  they are not);
- staged_vae_x2_shared: both (two vae-decode replicas, batch invariance off);
- pipeline: diffusers' `WanPipeline` alone, loaded once in its own process (one torch thread:
  OMP_NUM_THREADS=1 and torch.set_num_threads(1), as every stage process runs), serving the same 4 jobs one
  after another (`output_type="np"`: no MP4).
Same prompts, negative prompt, size, frames, steps, guidance (5.0, Wan's) and seeds on every side. frames/s =
frames made (4 x frames per job) / the wall time from the first submission to the last completion; rounds
alternate between the sides and each figure is the median of the rounds; each side's CPU seconds per round
(its processes' user + system time, psutil) are recorded beside it. Size: 128x128, 33 frames (9 latent
frames), 10 steps (--quick: 64x64): here WanPipeline takes ~3 s a video, ~93% of it in the video VAE's
decode (the tiny transformer is 2 layers of width 32 over 2x2 patches of the 16x16 latents; the tiny VAE,
base width 8 with one residual block a level, still runs its causal 3-D convolutions up to the full 128x128
frames), so the VAE stage is the bottleneck on both sides; a smaller size would mostly time the request
path's fixed costs.

`video.first_frame_s_over_total`: one Generate (gRPC, outputs [VIDEO]) on the idle staged side at the same
size: the time to its first VideoFrames event over the time to its last (median of rounds).

`video_jobs.lost_on_orchestrator_kill` and `video_jobs.takeover_s`: two more orchestrator replicas (as serve
starts its own, on the staged side's stages, one SQLite store and content folder of their own, concurrency 8,
the default 10 s lease). 8 jobs POSTed to the first; once it runs all 8 (each in_progress under its lease, one
with denoise progress) the second starts, then the first is killed with SIGKILL. Lost: jobs not completed in
the end; takeover_s: from the kill to the second replica's claim of the first killed job (the job's
`started_at`, written at its claim, read from the store).

`video_jobs.submit_p50_ms` / `_p95_ms`: POST /v1/videos latency (client side, keep-alive) on a replica that
runs no jobs (`--jobs-concurrency 0`) with 64 jobs queued: each timed POST is followed by a DELETE of the job
it made, so every POST sees exactly 64 queued.

    .venv/bin/python bench/video.py [--quick]

Writes bench/results/video.json (with the load averages before and after, and the settings).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the WanPipeline process too

import httpx
import yaml
from common import exit_on_sigterm, figure, percentile, print_table, write_results
from e2e_vs_monolith import cpu_seconds

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "wan-t2v-tiny.yaml"
MODELS = ROOT / "models"
MODEL = "wan-t2v-tiny"
JOBS = 4                 # jobs per round (the figures' c4)
KILL_JOBS = 8            # jobs the killed replica holds
QUEUED = 64              # jobs queued while POST latency is timed
SUBMITS, QUICK_SUBMITS = 100, 30
ROUNDS, QUICK_ROUNDS = 5, 2
FIRST_FRAME_ROUNDS, QUICK_FIRST_FRAME_ROUNDS = 3, 2
JOB_BOUND_S = 600        # a safety bound on jobs of the tiny model finishing on a loaded machine, never a figure
READY_BOUND_S = 180
# How often each job's status is read: a tenth of a 4-job round at the quick size (~2 s), and light enough
# (40 GETs/s for 4 jobs) that the polling is a small part of the orchestrator's CPU seconds.
POLL_S = 0.1
PROMPTS = ("a cat walks on grass", "waves break on a rocky shore at dusk", "a red car drives through the rain",
           "a paper boat floats down a stream")


@dataclass(frozen=True)
class Ask:
    width: int
    height: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float = 5.0   # WanPipeline's default
    fps: int = 16                 # Wan's
    negative_prompt: str = "blurry, low quality"


FULL, QUICK = Ask(128, 128, 33, 10), Ask(64, 64, 33, 10)
# The staged sides: stage replicas (serve's --replicas) and the vae-decode stage's engineArgs.
STAGED: dict[str, tuple[dict[str, int], dict]] = {
    "staged": ({}, {}),
    "staged_vae_x2": ({"vae-decode": 2}, {}),
    "staged_vae_shared": ({}, {"batch_invariant": False}),
    "staged_vae_x2_shared": ({"vae-decode": 2}, {"batch_invariant": False}),
}


def jobs(ask: Ask) -> list[dict]:
    """The round's jobs: prompt and seed each, the rest from `ask`."""
    return [{"prompt": p, "seed": 100 + i, **asdict(ask)} for i, p in enumerate(PROMPTS[:JOBS])]


# ---- the pipeline side: WanPipeline alone in its own process ------------------------------------------


def pipeline_main(conn, model_dir: str) -> None:
    """Load WanPipeline once (one torch thread), warm it, say "ready", then make each job sent (its frame count
    back) until None."""
    import torch
    from diffusers import WanPipeline

    torch.set_num_threads(1)
    pipe = WanPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)

    def make(job: dict) -> int:
        frames = pipe(job["prompt"], negative_prompt=job["negative_prompt"], height=job["height"],
                      width=job["width"], num_frames=job["num_frames"],
                      num_inference_steps=job["num_inference_steps"], guidance_scale=job["guidance_scale"],
                      generator=torch.Generator().manual_seed(job["seed"]), output_type="np").frames[0]
        return len(frames)

    make({"prompt": "warm", "seed": 0, **asdict(QUICK), "num_frames": 9, "num_inference_steps": 2})
    conn.send("ready")
    while (job := conn.recv()) is not None:
        conn.send(make(job))


class PipelineProcess:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch state from this one
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=pipeline_main, args=(child, str(MODELS / MODEL)), daemon=True)
        self.proc.start()
        if not (self.conn.poll(READY_BOUND_S) and self.conn.recv() == "ready"):
            self.close()
            raise RuntimeError("the WanPipeline process did not load the model")

    def run(self, batch: list[dict]) -> int:
        """The jobs one after another; frames made."""
        made = 0
        for job in batch:
            self.conn.send(job)
            made += self.conn.recv()
        return made

    def pids(self) -> dict[str, int]:
        return {"wan_pipeline": self.proc.pid}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


# ---- the staged side: `omnistage serve` of the example, driven through /v1/videos --------------------


def video_body(job: dict) -> dict:
    return {"model": MODEL, "prompt": job["prompt"], "size": f"{job['width']}x{job['height']}", "seed": job["seed"],
            "num_frames": job["num_frames"], "fps": job["fps"], "num_inference_steps": job["num_inference_steps"],
            "guidance_scale": job["guidance_scale"], "negative_prompt": job["negative_prompt"]}


def submit(http: httpx.Client, job: dict) -> str:
    r = http.post("/videos", json=video_body(job))
    if r.status_code != 200:
        raise RuntimeError(f"POST /v1/videos: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()["id"]


def wait_completed(http: httpx.Client, ids: list[str]) -> int:
    """Poll until every job completed (a failed one raises); frames made."""
    frames, waiting, end = 0, list(ids), time.monotonic() + JOB_BOUND_S
    while waiting:
        if time.monotonic() > end:
            raise RuntimeError(f"jobs not completed after {JOB_BOUND_S}s: {waiting}")
        for vid in list(waiting):
            v = http.get(f"/videos/{vid}").json()
            if v["status"] == "failed":
                raise RuntimeError(f"job {vid} failed: {v['error']}")
            if v["status"] == "completed":
                frames += v["num_frames"]
                waiting.remove(vid)
        time.sleep(POLL_S)
    return frames


class Staged:
    """The example as serve runs it (its jobs.concurrency raised to JOBS), with `replicas` overrides."""

    def __init__(self, tmp: Path, name: str, replicas: dict[str, int], vae_args: dict) -> None:
        from omnistage.api import parse_pipeline
        from omnistage.local.serve import LocalPipeline

        doc = yaml.safe_load(EXAMPLE.read_text())
        doc["spec"]["deployment"]["orchestrator"].setdefault("jobs", {})["concurrency"] = JOBS
        doc["spec"]["deployment"]["stages"]["vae-decode"].setdefault("engineArgs", {}).update(vae_args)
        work = tmp / name
        work.mkdir()
        path = work / "pipeline.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.local = LocalPipeline(path, parse_pipeline(doc), MODELS, progress=lambda m: None, api_port=0,
                                   replicas=replicas, log_dir=work / "logs", work_dir=work)
        try:
            self.local.start()
        except BaseException:  # the stages that did start are stopped too
            self.local.stop()
            raise
        self.http = httpx.Client(base_url=self.local.api_url, timeout=60)

    def run(self, batch: list[dict]) -> int:
        ids = [submit(self.http, job) for job in batch]
        frames = wait_completed(self.http, ids)
        for vid in ids:  # the store and content folder kept small between rounds (after the clock stopped)
            self.http.delete(f"/videos/{vid}")
        return frames

    def pids(self) -> dict[str, int]:
        return {p.name: p.popen.pid for p in self.local.all_procs()}

    def close(self) -> None:
        self.http.close()
        self.local.stop()


def timed(side, batch: list[dict]) -> dict:
    """One round of `batch` on `side`: frames/s, wall and the CPU seconds its processes used."""
    pids = side.pids()
    cpu0, t0 = cpu_seconds(pids), time.perf_counter()
    frames = side.run(batch)
    wall = time.perf_counter() - t0
    cpu1 = cpu_seconds(pids)
    used = {n: round(cpu1[n] - cpu0.get(n, 0.0), 2) for n in cpu1}
    return {"frames": frames, "wall_s": round(wall, 3), "frames_per_s": frames / wall,
            "cpu_s": round(sum(used.values()), 2), "cpu_s_by_process": used}


# ---- first frame over the whole video ------------------------------------------------------------------


async def first_frame_over_total(endpoint: str, job: dict) -> dict:
    import grpc

    from omnistage.client import build_request
    from omnistage.v1 import orchestrator_pb2_grpc

    request = build_request(outputs=["video"], prompt=job["prompt"], negative_prompt=job["negative_prompt"],
                            width=job["width"], height=job["height"], num_frames=job["num_frames"],
                            num_inference_steps=job["num_inference_steps"], guidance_scale=job["guidance_scale"],
                            seed=job["seed"], fps=job["fps"])
    times: list[float] = []
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        t0 = time.perf_counter()
        async for ev in stub.Generate(request, timeout=JOB_BOUND_S):
            if ev.WhichOneof("event") == "video":
                times.append(time.perf_counter() - t0)
    return {"first_s": times[0], "last_s": times[-1], "events": len(times), "ratio": times[0] / times[-1]}


# ---- more orchestrator replicas on the staged side's stages ---------------------------------------------


class Replica:
    """An orchestrator process as serve starts its own (file discovery of the stages, their mTLS), on a job
    store of its own; killed with SIGKILL or stopped with SIGTERM."""

    def __init__(self, local, tag: str, **flags) -> None:
        from omnistage.contract.launch import orchestrator_command

        self.ready_file, self.log = local.log_dir / f"{tag}.ready", local.log_dir / f"{tag}.log"
        argv = orchestrator_command(local.pipeline_file, host="127.0.0.1", port=0, http_port=0, api_port=0,
                                    discovery="file", endpoints_file=local.endpoints_file, wait_for_stages=30,
                                    ready_file=self.ready_file, tls_dir=local._tls_dirs.get(None), **flags)
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=local.env(), stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def ready(self):
        from omnistage.contract.launch import read_ready

        end = time.monotonic() + READY_BOUND_S
        while (ports := read_ready(self.ready_file)) is None:
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"orchestrator replica not ready:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        return ports

    def kill(self) -> None:
        from omnistage.local.process_group import kill_group

        kill_group(self.proc)

    def stop(self) -> None:
        from omnistage.local.process_group import stop_group

        stop_group(self.proc)


def api(ports) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{ports.api}/v1", timeout=60)


async def store_jobs(url: str, ids: list[str]):
    from orchestrator_service.jobs import open_store

    store = open_store(url, pipeline=MODEL)  # the pipeline's name: the example's metadata.name
    await store.open()
    try:
        return [await store.get(i, "") for i in ids]
    finally:
        await store.close()


def kill_replica(local, tmp: Path, job: dict) -> dict:
    """8 jobs on one replica, a second started, the first killed with -9 while it runs them."""
    from orchestrator_service.jobs.store import JobStatus

    url, content = f"sqlite:///{tmp / 'kill-jobs.db'}", tmp / "kill-content"
    flags = dict(jobs_store=url, jobs_content=content, jobs_concurrency=KILL_JOBS, jobs_max_queued_per_key=KILL_JOBS)
    first = Replica(local, "kill-first", **flags)
    second = None
    try:
        with api(first.ready()) as http:
            ids = [submit(http, {**job, "seed": 200 + i}) for i in range(KILL_JOBS)]
        end = time.monotonic() + JOB_BOUND_S
        while True:  # all 8 running on the first replica, at least one of them past a denoise step
            held = asyncio.run(store_jobs(url, ids))
            if (all(j.status == JobStatus.IN_PROGRESS for j in held) and len({j.lease_owner for j in held}) == 1
                    and any(j.progress > 0 for j in held)):
                break
            if any(j.status != JobStatus.QUEUED and j.status != JobStatus.IN_PROGRESS for j in held):
                raise RuntimeError("a job finished before the kill: make the jobs longer")
            if time.monotonic() > end:
                raise RuntimeError("the first replica never ran all the jobs")
            time.sleep(0.1)
        victim = held[0].lease_owner
        second = Replica(local, "kill-second", **flags)
        second.ready()
        held = asyncio.run(store_jobs(url, ids))
        running_at_kill = sum(j.status == JobStatus.IN_PROGRESS and j.lease_owner == victim for j in held)
        killed_at = time.time()
        first.kill()
        end = time.monotonic() + JOB_BOUND_S
        while True:
            done = asyncio.run(store_jobs(url, ids))
            if all(j.status in (JobStatus.COMPLETED, JobStatus.FAILED) for j in done):
                break
            if time.monotonic() > end:
                break  # the unfinished ones count as lost
            time.sleep(0.2)
        retaken = [j.started_at for j in done if j.attempts >= 2 and j.started_at]
        return {"lost": sum(j.status != JobStatus.COMPLETED for j in done), "running_at_kill": running_at_kill,
                "takeover_s": (min(retaken) - killed_at) if retaken else float("nan"),
                "attempts": [j.attempts for j in done], "completed_s_after_kill": round(time.time() - killed_at, 1),
                "lease_s": 10.0}
    finally:
        first.kill()
        if second is not None:
            second.stop()


def submit_latency(local, tmp: Path, job: dict, samples: int) -> dict:
    """POST /v1/videos latency with QUEUED jobs queued on a replica that runs none."""
    replica = Replica(local, "submit", jobs_store=f"sqlite:///{tmp / 'submit-jobs.db'}",
                      jobs_content=tmp / "submit-content", jobs_concurrency=0, jobs_max_queued_per_key=QUEUED + 1)
    try:
        with api(replica.ready()) as http:
            for i in range(QUEUED):
                submit(http, {**job, "seed": i})
            lat = []
            for i in range(samples):
                t0 = time.perf_counter()
                vid = submit(http, {**job, "seed": QUEUED + i})
                lat.append(1e3 * (time.perf_counter() - t0))
                http.delete(f"/videos/{vid}")
            queued = len(http.get("/videos", params={"limit": 100}).json()["data"])
        return {"p50_ms": percentile(lat, 50), "p95_ms": percentile(lat, 95), "samples": samples,
                "queued_after": queued}
    finally:
        replica.stop()


# ---- the run --------------------------------------------------------------------------------------------


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def measure(quick: bool) -> tuple[list[dict], dict]:
    ask = QUICK if quick else FULL
    batch = jobs(ask)
    rounds = QUICK_ROUNDS if quick else ROUNDS
    extra: dict = {"quick": quick, "ask": asdict(ask), "jobs": JOBS, "omp_num_threads": os.environ["OMP_NUM_THREADS"],
                   "load_before": load()}
    sides: dict = {}
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-video-") as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        sides["pipeline"] = PipelineProcess()
        stack.callback(sides["pipeline"].close)
        for name, (replicas, vae_args) in STAGED.items():
            sides[name] = Staged(tmp, name, replicas, vae_args)
            stack.callback(sides[name].close)
        for name in STAGED:  # warm every stage (first calls load kernels)
            sides[name].run(batch)
        results: dict[str, list[dict]] = {n: [] for n in sides}
        for r in range(rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                results[name].append(timed(sides[name], batch))
                print(f"round {r} {name}: {results[name][-1]}", flush=True)
        extra["rounds"] = results
        staged_local = sides["staged"].local
        first = [asyncio.run(first_frame_over_total(staged_local.endpoint, batch[0]))
                 for _ in range(QUICK_FIRST_FRAME_ROUNDS if quick else FIRST_FRAME_ROUNDS)]
        extra["first_frame"] = first
        print(f"first frame: {first}", flush=True)
        for name in STAGED:  # the variants' processes idle from here on: out of the way of the job figures
            if name != "staged":
                sides[name].close()
        # the full size even when quick: 8 jobs must still be running once the second replica is up
        kill = kill_replica(staged_local, tmp, {**batch[0], **asdict(FULL)})
        extra["kill"] = kill
        print(f"kill: {kill}", flush=True)
        sub = submit_latency(staged_local, tmp, batch[0], QUICK_SUBMITS if quick else SUBMITS)
        extra["submit"] = sub
    extra["load_after"] = load()

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in results[name])

    figures = [figure("video.pipeline.frames_per_s_c4", med("pipeline", "frames_per_s"), "frames/s"),
               figure("video.pipeline.cpu_s_c4", med("pipeline", "cpu_s"), "s")]
    for name in STAGED:  # each round's staged side over the pipeline side of the same round
        ratios = [s["frames_per_s"] / p["frames_per_s"] for s, p in zip(results[name], results["pipeline"])]
        figures += [figure(f"video.{name}_over_pipeline.frames_per_s_c4", statistics.median(ratios), "ratio"),
                    figure(f"video.{name}.frames_per_s_c4", med(name, "frames_per_s"), "frames/s"),
                    figure(f"video.{name}.cpu_s_c4", med(name, "cpu_s"), "s")]
    figures += [
        figure("video.first_frame_s_over_total", statistics.median(f["ratio"] for f in first), "ratio"),
        figure("video.first_frame_s", statistics.median(f["first_s"] for f in first), "s"),
        figure("video_jobs.lost_on_orchestrator_kill", kill["lost"], "jobs"),
        figure("video_jobs.takeover_s", kill["takeover_s"], "s"),
        figure("video_jobs.submit_p50_ms", sub["p50_ms"], "ms"),
        figure("video_jobs.submit_p95_ms", sub["p95_ms"], "ms"),
    ]
    return figures, extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64x64 videos, fewer rounds and samples")
    args = ap.parse_args()
    exit_on_sigterm()
    started = time.perf_counter()
    figures, extra = measure(args.quick)
    title = (f"Video: tiny Wan, {'quick' if args.quick else 'full'} run, "
             f"load {extra['load_before']} -> {extra['load_after']}")
    print_table(title, figures)
    path = write_results("video", figures, {**extra, "runtime_s": round(time.perf_counter() - started, 1)})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
