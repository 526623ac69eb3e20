"""The transformers Talker (stage_service's step loop) on the same Thinker rows."""
import sys, time, json
sys.path.insert(0, "/work/main")
import torch
torch.set_num_threads(1)
from stage_service.engines.qwen3_omni_steps import Talker
from stage_service.engines.omni_talker import END_OF_TEXT
from stage_service.engines.sampling import SamplingSettings
from common import request

def make_state(talker, seed, max_frames, penalty=1.0):
    ids, embeds, hidden = request(seed)
    n = len(ids)
    st = talker.new_state(ids, embeds[:n + 1], hidden[:n + 1], SamplingSettings(repetition_penalty=penalty), max_frames)
    st.inbox.append(embeds[n + 1:]); st.inbox.append(END_OF_TEXT)
    return st

def run(talker, seeds, max_frames, penalty=1.0):
    states = [make_state(talker, s, max_frames, penalty) for s in seeds]
    frames = {s: [] for s in seeds}
    live = list(zip(seeds, states))
    steps = 0
    while live:
        out = talker.step_batch([st for _, st in live])
        steps += 1
        nxt = []
        for (s, st), o in zip(live, out):
            if o.frame is not None:
                frames[s].append(o.frame)
            if o.finish_reason is None:
                nxt.append((s, st))
        live = nxt
    return frames, states

if __name__ == "__main__":
    root, bi = sys.argv[1], sys.argv[2] == "1"
    max_frames = int(sys.argv[3]); penalty = float(sys.argv[4]); seeds = [int(x) for x in sys.argv[5].split(",")]
    talker = Talker(root, batch_invariant=bi)
    frames, states = run(talker, seeds, max_frames, penalty)
    json.dump({str(k): v for k, v in frames.items()}, open(f"/tmp/talker_vllm/ref_bi{int(bi)}_p{penalty}_f{max_frames}.json", "w"))
    for s, st in zip(seeds, states):
        print(s, len(frames[s]), st.finish_reason, st.tokens[:8])
