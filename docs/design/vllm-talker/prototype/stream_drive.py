"""Streaming Thinker rows: they arrive while the Talker decodes (a feeder thread), some slower than it;
vLLM's scheduler (our subclass) defers a request whose next row has not come. Compare with the reference."""
import json, os, sys, threading, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/tmp/talker_vllm")
import torch
torch.set_num_threads(1)
import talker_plugin
talker_plugin.register()
from vllm import LLM, SamplingParams
from stage_service.engines.qwen3_omni_steps import Talker
from drive import talker_inputs

F = 40
seeds = list(range(1, 17))
ref = Talker("/tmp/talker_vllm/ckpt", batch_invariant=False)
llm = LLM(model="/tmp/talker_vllm/view", skip_tokenizer_init=True, enable_prompt_embeds=True, dtype="float32",
          enforce_eager=True, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64,
          enable_prefix_caching=False, async_scheduling=False, seed=0,
          scheduler_cls="talker_plugin.TalkerScheduler" if os.environ.get("GATE", "1") == "1" else None,
          kv_transfer_config={"kv_connector": "TalkerConnector", "kv_connector_module_path": "talker_plugin",
                              "kv_role": "kv_both"})
prompts, params, delays = [], [], {}
for s in seeds:
    emb, payload = talker_inputs(ref, s)
    rows = payload.pop("rows")[:-1]  # the end-of-text row is the model's to add once the stream ends
    key = f"talker-{s}"
    talker_plugin.STREAM[key] = {"rows": rows, "arrived": 0, "ended": False, "lock": threading.Lock()}
    delays[key] = 0.02 * (s % 4)  # 0, 20, 40, 60 ms a row: most slower than a Talker step
    payload.update(stream_key=key, eos=ref.tts_eos.tolist())
    prompts.append({"prompt_embeds": emb})
    params.append(SamplingParams(temperature=0.0, max_tokens=F + 1, stop_token_ids=[ref.eos], repetition_penalty=1.05,
                                 detokenize=False, extra_args={"kv_transfer_params": payload}))

def feed(key, delay):
    src = talker_plugin.STREAM[key]
    for i in range(len(src["rows"])):
        time.sleep(delay)
        with src["lock"]:
            src["arrived"] = i + 1
    time.sleep(delay)
    with src["lock"]:
        src["ended"] = True

threads = [threading.Thread(target=feed, args=(k, d), daemon=True) for k, d in delays.items()]
t0 = time.perf_counter()
for t in threads:
    t.start()
outs = llm.generate(prompts, params, use_tqdm=False)
print("seconds", round(time.perf_counter() - t0, 3), "deferrals", talker_plugin.DEFERRED["n"])
refd = json.load(open("/tmp/talker_vllm/ref_bi0_p1.05_f40.json"))
ok = 0
for s, o in zip(seeds, outs):
    toks = list(o.outputs[0].token_ids)
    st = next(v for k, v in talker_plugin.RESULTS.items() if k == o.request_id or k.rpartition('-')[0] == o.request_id)
    frames = [[toks[j]] + st.residual[j] for j in range(len(st.residual))]
    ok += frames == refd[str(s)]
    if frames != refd[str(s)]:
        print("seed", s, "differs at", next(j for j, (a, b) in enumerate(zip(frames, refd[str(s)])) if a != b))
print(f"STREAM equal {ok}/{len(seeds)}")
