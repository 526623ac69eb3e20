"""Run the Talker prototype on vLLM (in-process engine) and compare with the transformers Talker."""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/tmp/talker_vllm")
import torch
torch.set_num_threads(1)
import talker_plugin
talker_plugin.register()
from vllm import LLM, SamplingParams
from stage_service.engines.qwen3_omni_steps import Talker
from common import request

MAX_FRAMES = int(os.environ.get("MAX_FRAMES", 20))
PENALTY = float(os.environ.get("PENALTY", 1.0))

def talker_inputs(ref: Talker, seed: int):
    ids, embeds, hidden = request(seed)
    n = len(ids)
    with torch.inference_mode():
        prompt = ref._prefill(ids, embeds[:n], hidden[:n], embeds[n], "ethan")
        rows = torch.cat([ref.model.text_projection(embeds[n + 1:]), ref.tts_eos[None]])
    payload = {"prompt_len": prompt.shape[0], "rows": rows.tolist(), "pad": ref.tts_pad.tolist()}
    return prompt.clone(), payload

def main(seeds):
    ref = Talker("/tmp/talker_vllm/ckpt", batch_invariant=False)
    llm = LLM(model="/tmp/talker_vllm/view16", skip_tokenizer_init=True, enable_prompt_embeds=True, dtype="float32",
              enforce_eager=True, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=int(os.environ.get("MNBT", 2048)),
              enable_prefix_caching=False, async_scheduling=False, seed=0,
              kv_transfer_config={"kv_connector": "TalkerConnector", "kv_connector_module_path": "talker_plugin",
                                  "kv_role": "kv_both"})
    prompts, params = [], []
    for s in seeds:
        emb, payload = talker_inputs(ref, s)
        prompts.append({"prompt_embeds": emb})
        params.append(SamplingParams(temperature=0.0, max_tokens=MAX_FRAMES + 1, stop_token_ids=[ref.eos],
                                     repetition_penalty=PENALTY, detokenize=False,
                                     extra_args={"kv_transfer_params": payload}))
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    res = {}
    for s, o in zip(seeds, outs):
        toks = list(o.outputs[0].token_ids)
        st = next(v for k, v in talker_plugin.RESULTS.items() if k == o.request_id or k.rpartition('-')[0] == o.request_id)
        frames = [[toks[j]] + st.residual[j] for j in range(len(st.residual))]
        res[str(s)] = frames
        print(s, "tokens", toks, o.outputs[0].finish_reason)
    print("seconds", round(dt, 3))
    return res

if __name__ == "__main__":
    seeds = [int(x) for x in sys.argv[1].split(",")]
    res = main(seeds)
    json.dump(res, open(f"/tmp/talker_vllm/vllm_last.json", "w"))
    refp = os.environ.get("REF", f"/tmp/talker_vllm/ref_bi0_p{PENALTY}_f{MAX_FRAMES}.json")
    if os.path.exists(refp):
        ref = json.load(open(refp))
        for s in res:
            if s in ref:
                same = res[s] == ref[s]
                first = next((j for j, (a, b) in enumerate(zip(res[s], ref[s])) if a != b), None)
                print(f"seed {s}: frames vLLM {len(res[s])} ref {len(ref[s])} equal={same} first_diff={first}")
