"""frames/s: transformers Talker step loop vs the vLLM prototype, c1 (one request at a time) and c16."""
import os, sys, time, json
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/tmp/talker_vllm")
import torch
torch.set_num_threads(1)
import talker_plugin
talker_plugin.register()
from vllm import LLM, SamplingParams
from stage_service.engines.qwen3_omni_steps import Talker
import ref as R
from drive import talker_inputs

F = int(os.environ.get("MAX_FRAMES", 64))
PEN = 1.05
t_bi = Talker("/tmp/talker_vllm/ckpt", batch_invariant=True)
t_nb = Talker("/tmp/talker_vllm/ckpt", batch_invariant=False)
llm = LLM(model="/tmp/talker_vllm/view", skip_tokenizer_init=True, enable_prompt_embeds=True, dtype="float32",
          enforce_eager=True, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=2048,
          enable_prefix_caching=False, async_scheduling=False, seed=0,
          kv_transfer_config={"kv_connector": "TalkerConnector", "kv_connector_module_path": "talker_plugin",
                              "kv_role": "kv_both"})
inputs = {s: talker_inputs(t_nb, s) for s in range(1, 17)}

def v(seeds):
    ps = [{"prompt_embeds": inputs[s][0]} for s in seeds]
    sp = [SamplingParams(temperature=0.0, max_tokens=F + 1, stop_token_ids=[t_nb.eos], repetition_penalty=PEN,
                         detokenize=False, extra_args={"kv_transfer_params": inputs[s][1]}) for s in seeds]
    outs = llm.generate(ps, sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) - 1 for o in outs)

def hf(talker):
    def go(seeds):
        frames, _ = R.run(talker, seeds, F, PEN)
        return sum(len(f) for f in frames.values())
    return go

def timed(fn, seeds, serial):
    t, c = time.perf_counter(), time.process_time()
    n = sum(fn([s]) for s in seeds) if serial else fn(seeds)
    return round(n / (time.perf_counter() - t), 1), round(n / (time.process_time() - c), 1)

engines = {"transformers_bi": hf(t_bi), "transformers": hf(t_nb), "vllm_proto": v}
for name, fn in engines.items():  # warm-up
    fn([1, 2])
res = {}
for rep in range(int(os.environ.get("REPS", 3))):
    for name, fn in engines.items():
        res.setdefault(name, {}).setdefault("c1", []).append(timed(fn, [1, 2, 3, 4], True))
        res[name].setdefault("c16", []).append(timed(fn, list(range(1, 17)), False))
print("RESULT", json.dumps(res))
print("THREADS", torch.get_num_threads())
for k in list(talker_plugin.TIMES): talker_plugin.TIMES[k] = 0
t = time.perf_counter(); n = v(list(range(1, 17))); wall = time.perf_counter() - t
print("VLLM_C16_BREAKDOWN", json.dumps({"wall_s": round(wall, 3), "frames": n, **{k: round(x, 3) for k, x in talker_plugin.TIMES.items()}}))
for k in list(talker_plugin.TIMES): talker_plugin.TIMES[k] = 0
t = time.perf_counter(); n = v([1]); wall = time.perf_counter() - t
print("VLLM_C1_BREAKDOWN", json.dumps({"wall_s": round(wall, 3), "frames": n, **{k: round(x, 3) for k, x in talker_plugin.TIMES.items()}}))
import cProfile, pstats
pr = cProfile.Profile(); pr.enable(); hf(t_bi)(list(range(1, 17))); pr.disable()
st = pstats.Stats(pr); print("HF_C16_TOTAL", round(st.total_tt, 3))

