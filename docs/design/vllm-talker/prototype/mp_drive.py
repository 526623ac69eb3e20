"""The engine core in its own process (vLLM's default): residual codes come back over ZMQ."""
import json, os, sys, threading, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
EP = "ipc:///tmp/talker_vllm/codes.sock"
os.environ["TALKER_CODES_ENDPOINT"] = EP
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/tmp/talker_vllm")
import torch, zmq
torch.set_num_threads(1)
import talker_plugin
talker_plugin.register()
from vllm import LLM, SamplingParams
from stage_service.engines.qwen3_omni_steps import Talker
from drive import talker_inputs

def main():
    F = 40
    seeds = list(range(1, 17))
    sock = zmq.Context.instance().socket(zmq.PULL); sock.bind(EP)
    got = {}
    def pump():
        while True:
            for rid, k, codes in json.loads(sock.recv()):
                got.setdefault(rid, {})[k] = codes
    threading.Thread(target=pump, daemon=True).start()
    ref = Talker("/tmp/talker_vllm/ckpt", batch_invariant=False)
    llm = LLM(model="/tmp/talker_vllm/view", skip_tokenizer_init=True, enable_prompt_embeds=True, dtype="float32",
              enforce_eager=True, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=2048,
              enable_prefix_caching=False, async_scheduling=False, seed=0,
              kv_transfer_config={"kv_connector": "TalkerConnector", "kv_connector_module_path": "talker_plugin",
                                  "kv_role": "kv_both"})
    inputs = {s: talker_inputs(ref, s) for s in seeds}
    def go(ss):
        return llm.generate([{"prompt_embeds": inputs[s][0]} for s in ss],
                            [SamplingParams(temperature=0.0, max_tokens=F + 1, stop_token_ids=[ref.eos], repetition_penalty=1.05,
                                            detokenize=False, extra_args={"kv_transfer_params": inputs[s][1]}) for s in ss],
                            use_tqdm=False)
    go([1, 2])
    t = time.perf_counter(); outs = go(seeds); c16 = 16 * F / (time.perf_counter() - t)
    t = time.perf_counter()
    for s in [1, 2, 3, 4]:
        go([s])
    c1 = 4 * F / (time.perf_counter() - t)
    time.sleep(0.5)
    refd = json.load(open("/tmp/talker_vllm/ref_bi0_p1.05_f40.json"))
    ok = 0
    for s, o in zip(seeds, outs):
        toks = list(o.outputs[0].token_ids)
        key = next(k for k in got if k == o.request_id or k.rpartition('-')[0] == o.request_id)
        frames = [[toks[j]] + got[key][j] for j in range(len(toks) - 1)]
        ok += frames == refd[str(s)]
    print(f"MP equal {ok}/{len(seeds)}  frames/s c1 {c1:.1f} c16 {c16:.1f}")

if __name__ == "__main__":
    main()
