"""`omnistage serve` + `omnistage generate` for every example, as a user runs them: real processes."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import wave
from pathlib import Path

import psutil
import pytest
from PIL import Image

from ..conftest import EXAMPLES, REPO
from ..polling import wait_until_sync

OMNISTAGE = [sys.executable, "-m", "omnistage.local.cli"]


class Served:
    """A running `omnistage serve` whose output is collected line by line. `pipeline`: an example's name, or
    the path of a pipeline file."""

    def __init__(self, pipeline: str | Path, model_dir: Path, tmp: Path, *extra: str):
        path = pipeline if isinstance(pipeline, Path) else EXAMPLES / f"{pipeline}.yaml"
        self.log = tmp / f"serve-{path.stem}.out"
        self.proc = subprocess.Popen([*OMNISTAGE, "serve", str(path), "--models",
                                      str(model_dir), "--log-dir", str(tmp / f"logs-{path.stem}"), *extra],
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT, cwd=REPO)
        self.endpoint = self.wait_for(r"serving on (127\.0\.0\.1:\d+)", 300)
        self.pids = {int(p) for p in re.findall(r"\(pid (\d+)\)", self.output())}
        # Each process as serve names it ("stage llm[0]", "orchestrator") -> its pid.
        self.processes = {name: int(pid) for name, pid in
                          re.findall(r"  (stage \S+|orchestrator): ready .*\(pid (\d+)\)", self.output())}

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, pattern: str, timeout: float) -> str:
        def found():
            m = re.search(pattern, self.output())
            if not m and self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n{self.output()}")
            return m

        return wait_until_sync(found, timeout, 0.1, what=repr(pattern), detail=lambda: "\n" + self.output()).group(1)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def generate(endpoint: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*OMNISTAGE, "generate", "--endpoint", endpoint, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def descendants_alive(pids: set[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def omni(model_dir, tmp_path_factory):
    s = Served("qwen3-omni-tiny", model_dir, tmp_path_factory.mktemp("omni"))
    yield s
    if s.proc.poll() is None:
        s.stop()


def test_qwen3_omni_text_and_wav(omni, tmp_path):
    out = tmp_path / "a.wav"
    r = generate(omni.endpoint, "--prompt", "Hello there", "--max-tokens", "8", "--max-codec-frames", "30",
                 "--out", str(out), "--return-trace")
    assert r.returncode == 0, r.stderr
    text = r.stdout.splitlines()[0]
    assert text.strip(), r.stdout
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24000 and w.getnchannels() == 1 and w.getsampwidth() == 2
        assert w.getnframes() > 0
    assert re.search(r"thinker\s+127\.0\.0\.1:\d+", r.stdout) and "code2wav" in r.stdout


def get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read()


def test_every_process_serves_metrics_and_probes_where_serve_says(omni):
    targets_file = Path(omni.wait_for(r"Prometheus targets \(file_sd_configs\): (\S+)", 30))
    printed = dict(re.findall(r"^ +(stage \S+|orchestrator) +(http://\S+)/metrics +\2/readyz +\2/livez$",
                              omni.output(), re.M))
    assert sorted(printed) == ["orchestrator", "stage code2wav[0]", "stage talker[0]", "stage thinker[0]"]
    for url in printed.values():
        status, body = get(url + "/metrics")
        assert status == 200 and b"omnistage_" in body
        assert get(url + "/readyz") == (200, b"ready\n") and get(url + "/livez")[0] == 200
    targets = json.loads(targets_file.read_text())
    assert {t["labels"]["process"]: t["targets"] for t in targets} == {
        name: [url.removeprefix("http://")] for name, url in printed.items()}
    assert all(t["labels"] == {"job": "omnistage", "pipeline": "qwen3-omni-tiny", "process": t["labels"]["process"]}
               for t in targets)
    api = omni.wait_for(r"OpenAI API: (http://127\.0\.0\.1:\d+/v1)\n", 5)
    assert get(api + "/models")[0] == 200


def test_the_openai_sdk_and_plain_http_against_serve(omni, tmp_path):
    """What a user of `omnistage serve` does with the OpenAI SDK: the base URL serve printed, chat with text
    and audio out, speech; and the README's curl line as plain HTTP."""
    import base64
    import http.client

    from openai import OpenAI

    api = omni.wait_for(r"OpenAI API: (http://127\.0\.0\.1:\d+/v1)\n", 5)
    client = OpenAI(base_url=api, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="qwen3-omni-tiny", modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"},
        max_tokens=6, seed=1, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Tell me about the sea"}])
    message = reply.choices[0].message
    assert message.content and message.audio.transcript == message.content
    with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as w:
        assert w.getframerate() == 24000 and w.getnframes() > 0
    assert reply.usage.completion_tokens == 6 and reply.usage.prompt_tokens > 0
    speech = client.audio.speech.create(model="qwen3-omni-tiny", voice="ethan", input="Hello there",
                                        response_format="wav")
    with wave.open(io.BytesIO(speech.content)) as w:
        assert w.getframerate() == 24000 and w.getnframes() > 0

    host, port = re.match(r"http://([\d.]+):(\d+)/v1", api).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"model": "qwen3-omni-tiny", "max_tokens": 4,
                                  "messages": [{"role": "user", "content": "Hello"}]}))
    r = conn.getresponse()
    body = json.loads(r.read())
    assert r.status == 200 and r.getheader("Content-Type") == "application/json"
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 4


def test_bad_request_names_the_field_and_serving_continues(omni, tmp_path):
    r = generate(omni.endpoint, "--prompt", "hi", "--max-tokens", "100000")
    assert r.returncode == 1 and "INVALID_ARGUMENT: params.text.max_tokens" in r.stderr
    r = generate(omni.endpoint, "--prompt", "hi", "--output", "image")
    assert r.returncode == 1 and "INVALID_ARGUMENT: outputs[0]" in r.stderr
    r = generate(omni.endpoint, "--prompt", "hi", "--max-tokens", "2", "--max-codec-frames", "3",
                 "--out", str(tmp_path / "b.wav"))
    assert r.returncode == 0, r.stderr


def test_a_stage_dying_mid_request_is_unavailable_naming_it_and_restarted(omni):
    import grpc

    from omnistage.client import OmniClient

    talker_pid = int(re.search(r"stage talker\[0\]: ready .* \(pid (\d+)\)", omni.output()).group(1))
    seen = []
    with OmniClient(omni.endpoint) as client, pytest.raises(grpc.RpcError) as e:
        for ev in client.stream("a long answer", max_tokens=64, max_codec_frames=2000, timeout=120):
            seen.append(ev.WhichOneof("event"))
            if seen.count("audio") == 1 and len(seen) and seen[-1] == "audio":
                os.kill(talker_pid, signal.SIGKILL)  # mid-request: the talker has 1,975 frames to go
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "stage talker" in e.value.details()
    assert seen.count("audio") == 1 and "final" not in seen
    # its only replica: serve restarts it (docs/faults.md), and keeps serving once it is back
    omni.wait_for(rf"(stage talker\[0\] \(pid {talker_pid}\) exited with code -9 while serving; out of service, "
                  rf"restart 1 in 1s)", 60)
    omni.wait_for(r"(stage talker\[0\]: ready on \S+ after [\d.]+s, in service)", 300)
    r = generate(omni.endpoint, "--prompt", "again", "--max-tokens", "8", "--max-codec-frames", "25")
    assert r.returncode == 0, r.stderr
    assert omni.proc.poll() is None and descendants_alive({talker_pid}) == []


def serves_a_png(example: str, model_dir: Path, tmp: Path, *extra: str) -> Served:
    """`omnistage serve` of an image example answers `generate` with an RGB PNG of the requested size,
    then stops cleanly with every process it started."""
    s = Served(example, model_dir, tmp, *extra)
    try:
        out = tmp / "img.png"
        r = generate(s.endpoint, "--prompt", "a red car", "--width", "96", "--height", "64",
                     "--num-inference-steps", "3", "--out", str(out))
        assert r.returncode == 0, r.stderr
        img = Image.open(io.BytesIO(out.read_bytes()))
        assert img.size == (96, 64) and img.mode == "RGB"
        assert "image: 96x64" in r.stdout
    finally:
        assert s.stop() == 0
    assert descendants_alive(s.pids) == []
    return s


def test_text_to_image_png_at_the_requested_size_without_the_openai_api(model_dir, tmp_path):
    s = serves_a_png("text-to-image-tiny", model_dir, tmp_path, "--no-api")
    assert "OpenAI API" not in s.output() and "Prometheus targets" in s.output()


def test_openai_sdk_images_against_serve(model_dir, tmp_path):
    import base64

    from openai import OpenAI

    s = Served("text-to-image-tiny", model_dir, tmp_path)
    try:
        api = s.wait_for(r"OpenAI API: (http://127\.0\.0\.1:\d+/v1)\n", 5)
        client = OpenAI(base_url=api, api_key="unused", max_retries=0)
        out = client.images.generate(model="text-to-image-tiny", prompt="a red car", size="96x64",
                                     response_format="b64_json", extra_body={"num_inference_steps": 3})
        img = Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json)))
        assert img.size == (96, 64) and img.format == "PNG"
    finally:
        assert s.stop() == 0
    assert descendants_alive(s.pids) == []


@pytest.mark.vllm
def test_llm_on_vllm_streams_tokens(model_dir, tmp_path):
    s = Served("llm-tiny", model_dir, tmp_path)
    try:
        r = generate(s.endpoint, "--prompt", "Hello", "--max-tokens", "12", "--ignore-eos")
        assert r.returncode == 0, r.stderr
        assert "completion tokens 12" in r.stdout
        server_children = psutil.Process(s.proc.pid).children(recursive=True)
    finally:
        assert s.stop() == 0
    # vLLM's engine-core helper process goes down with its stage (it notices its parent's exit itself,
    # so allow it a bounded moment on a loaded machine).
    children = {p.pid for p in server_children}
    wait_until_sync(lambda: not descendants_alive(children), timeout=15,
                    what="vLLM's engine-core helper to exit after its stage",
                    detail=lambda: descendants_alive(children))


def test_validate_lists_every_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((EXAMPLES / "qwen3-omni-tiny.yaml").read_text()
                   .replace("- stage: thinker", "- stage: thinkr").replace("replicas: 1", "replicas: -1", 1))
    r = subprocess.run([*OMNISTAGE, "validate", str(bad)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1
    assert 'spec.topology.stages[1].inputs[0]: unknown stage "thinkr"' in r.stderr
    assert "spec.deployment.orchestrator.replicas: must be >= 0, got -1" in r.stderr
    good = subprocess.run([*OMNISTAGE, "validate", *map(str, sorted(EXAMPLES.glob("*.yaml")))],
                          capture_output=True, text=True, cwd=REPO)
    assert good.returncode == 0 and good.stdout.count(": ok") == len(list(EXAMPLES.glob("*.yaml")))


def test_serve_refuses_an_invalid_file_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((EXAMPLES / "llm-tiny.yaml").read_text().replace("kind: ar", "kind: autoregressive"))
    t0 = time.monotonic()
    r = subprocess.run([*OMNISTAGE, "serve", str(bad)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and 'spec.topology.stages[0].kind: "autoregressive" is not one of' in r.stderr
    assert "starting" not in r.stdout and time.monotonic() - t0 < 30
