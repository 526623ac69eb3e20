"""Headline benchmark: the staged pipeline against the monolithic model, side by side, same weights.

(a) monolith: transformers' combined `Qwen3OmniMoeForConditionalGeneration.generate`, one request at a
    time, as a user of that library runs it (one process, one torch thread);
(b) staged:   `omnistage serve examples/qwen3-omni-tiny.yaml` (Thinker, Talker, Code2Wav as separate
    processes, one torch thread each, async chunk streaming on) called by a load generator at
    concurrency 1, 8 and 32.
Both compute the same thing: the stages are the combined model's own sub-models, greedy decoding, the
same prompts (a fixed, seeded mix of short and long), the same token and codec-frame budgets.

    .venv/bin/python bench/e2e_vs_monolith.py [--quick] [--device cuda]

With --device cuda both sides run on the first GPU in bfloat16 (the monolith moved there; the three stages
share it, a third of its memory each) and the results go to bench/results/gpu/e2e_vs_monolith.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from common import (add_device_argument, exit_on_sigterm, figure, on_gpu, percentile, print_table,  # noqa: E402
                    require_device, results_name, write_results)
from omni_load import prompts, run_level, serve_local  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def monolith(prompt_set, frames: int, model_dir: Path, device: str = "cpu") -> dict:
    import torch
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from stage_service.engines.chat import chat_prompt_ids, load_chat_template
    from stage_service.engines.qwen3_omni_steps import SAMPLE_RATE

    torch.set_num_threads(1)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir).eval()
    if device == "cuda":
        model = model.to("cuda", torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    template = load_chat_template(model_dir, tokenizer)  # the chat template the Thinker stage applies
    lat, tokens, audio_s = [], 0, 0.0
    t_all = time.perf_counter()
    for text, max_tokens in prompt_set:
        ids = torch.tensor([chat_prompt_ids(tokenizer, template, text)], device=device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            seq, wav = model.generate(input_ids=ids, thinker_max_new_tokens=max_tokens, thinker_eos_token_id=None,
                                      talker_max_new_tokens=frames + 1, talker_do_sample=False)
            wav = wav.cpu()  # the audio reaches its user in host memory (and the GPU's work is done)
        lat.append(time.perf_counter() - t0)
        tokens += seq.shape[1] - ids.shape[1]
        audio_s += wav.shape[-1] / SAMPLE_RATE
    wall = time.perf_counter() - t_all
    return {"rps": len(prompt_set) / wall, "tok_s": tokens / wall, "ttfp": lat,  # audio arrives with the result
            "rtf": sum(lat) / audio_s, "n": len(prompt_set)}


def staged(levels: dict[int, int], frames: int, models: Path, seed: int, device: str = "cpu") -> dict[int, dict]:
    edit = (lambda doc: on_gpu(doc, fraction=0.3, dtype="bfloat16")) if device == "cuda" else None
    with serve_local(models, edit) as endpoint:
        return {c: asyncio.run(run_level(endpoint, prompts(n, seed), frames, c)) for c, n in levels.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=str(ROOT / "models"))
    add_device_argument(ap)
    args = ap.parse_args()
    require_device(args.device)
    exit_on_sigterm()
    model_dir = Path(args.models) / "qwen3-omni-tiny"
    frames = 50  # 4 s of audio per request
    n_mono = 6 if args.quick else 16
    levels = {1: 6, 8: 16, 32: 32} if args.quick else {1: 16, 8: 48, 32: 96}
    mono = monolith(prompts(n_mono), frames, Path(model_dir), args.device)
    st = staged(levels, frames, Path(args.models), 0, args.device)
    rows = [("monolith (c1)", mono)] + [(f"staged c{c}", r) for c, r in st.items()]
    print(f"\n{'side':<16}{'req/s':>8}{'tok/s':>8}{'TTFP p50':>10}{'TTFP p95':>10}{'RTF':>7}{'n':>5}")
    for name, r in rows:
        print(f"{name:<16}{r['rps']:>8.2f}{r['tok_s']:>8.1f}{1e3 * percentile(r['ttfp'], 50):>9.0f}ms"
              f"{1e3 * percentile(r['ttfp'], 95):>8.0f}ms{r['rtf']:>7.2f}{r['n']:>5}")
    figures = [figure("monolith.rps", mono["rps"], "req/s"), figure("monolith.tok_s", mono["tok_s"], "tok/s"),
               figure("monolith.ttfp_p50_ms", 1e3 * percentile(mono["ttfp"], 50), "ms"),
               figure("monolith.ttfp_p95_ms", 1e3 * percentile(mono["ttfp"], 95), "ms"),
               figure("monolith.rtf", mono["rtf"], "ratio")]
    for c, r in st.items():
        figures += [figure(f"staged.rps_c{c}", r["rps"], "req/s"), figure(f"staged.tok_s_c{c}", r["tok_s"], "tok/s"),
                    figure(f"staged.ttfp_p50_c{c}_ms", 1e3 * percentile(r["ttfp"], 50), "ms"),
                    figure(f"staged.ttfp_p95_c{c}_ms", 1e3 * percentile(r["ttfp"], 95), "ms"),
                    figure(f"staged.rtf_c{c}", r["rtf"], "ratio")]
    figures += [figure("staged_over_monolith.rps_c8", st[8]["rps"] / mono["rps"], "ratio"),
                figure("staged_over_monolith.rps_c32", st[32]["rps"] / mono["rps"], "ratio"),
                figure("staged_over_monolith.tok_s_c8", st[8]["tok_s"] / mono["tok_s"], "ratio"),
                figure("monolith_over_staged.ttfp_p50_c1",
                       percentile(mono["ttfp"], 50) / percentile(st[1]["ttfp"], 50), "ratio")]
    print_table("figures", figures)
    extra = {"quick": args.quick, "codec_frames": frames, "device": args.device}
    print(f"\nwrote {write_results(results_name('e2e_vs_monolith', args.device), figures, extra)}")


if __name__ == "__main__":
    main()
