"""Qwen2.5-Omni's Thinker, Talker and Token2Wav, each behind a real stage service on port 0, loading the
tiny model from its published layout (one combined, sharded checkpoint): what each streams, that each
reads only its part of the checkpoint, that step batching changes nothing, that chunked Token2Wav
matches decoding the whole sequence, and `omnistage serve` answering a request with text and audio."""

from __future__ import annotations

import struct
import wave

import grpc
import pytest
import torch

from omnistage.checkpoints.shards import ShardedCheckpoint
from omnistage.contract import tensors
from omnistage.v1 import stage_pb2
from stage_service.engines.omni.audio import to_pcm16
from stage_service.engines.qwen2_5_omni.steps import SPEECH_SYSTEM_PROMPT, THINKER_EMBEDDINGS

from ..harness import call_stage, example, header, stage_servers_fixture, tensor_of, token_ids
from ..local.test_cli_serve import Served, generate
from .test_stage_batching import joins_a_burst, joins_a_running_batch
from .test_stage_support import scheduler

MODEL = "qwen2.5-omni-tiny"
PIPELINE = example(MODEL, lambda d: (scheduler("talker")(d), scheduler("token2wav")(d)))
SAMPLES_PER_TOKEN = 480  # a codec token is 2 mel frames of 240 samples at 24 kHz
CODEBOOK = 8194          # Token2Wav embeds codec ids 0..num_embeds (8193)


servers = stage_servers_fixture(PIPELINE)


def codes_of(chunks) -> torch.Tensor:
    return torch.cat([tensor_of(c, "codes") for c in chunks], 1)


def codes_chunk(chunk_id: int, codes: torch.Tensor, end: bool) -> stage_pb2.Chunk:
    return stage_pb2.Chunk(stage="talker", chunk_id=chunk_id, end_of_stream=end,
                           tensors=[tensors.to_proto("codes", codes)])


def header_length(shard) -> int:
    with open(shard, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt())


async def test_thinker_renders_the_chat_template_and_streams_rows(servers, model_dir):
    thinker = servers["thinker"]
    out = await call_stage(thinker.port, header(prompt="Hello there", max_tokens=6, ignore_eos=True))
    prompt = tensor_of(out[0], "prompt_token_ids").tolist()
    tokenizer = thinker.engine.thinker.tokenizer
    # As the processor renders a conversation: with the system prompt speech output needs.
    assert tokenizer.decode(prompt) == (f"<|im_start|>system\n{SPEECH_SYSTEM_PROMPT}<|im_end|>\n"
                                        "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
    tokens = token_ids(out)
    assert [len(tensor_of(c, "token_ids")) for c in out] == [4, 2] and out[-1].finish_reason == "length"
    embeds = torch.cat([tensor_of(c, "embeds") for c in out])
    hidden = torch.cat([tensor_of(c, "hidden") for c in out])
    # Every position fed (the prompt, then each token but the last): its embedding and its last hidden row.
    fed = prompt + tokens[:-1]
    table = ShardedCheckpoint(model_dir / MODEL).read(THINKER_EMBEDDINGS)
    assert torch.equal(embeds, table[fed]) and hidden.shape == embeds.shape
    assert "".join(c.text for c in out).strip()
    # Token ids are taken as they are, no template.
    given = await call_stage(thinker.port, header(request_id="ids", prompt_token_ids=prompt[:5], max_tokens=2))
    assert tensor_of(given[0], "prompt_token_ids").tolist() == prompt[:5]


async def test_thinker_takes_the_requests_system_prompt_or_the_raw_prompt(servers):
    thinker = servers["thinker"]

    async def rendered(request_id: str, **params) -> str:
        out = await call_stage(thinker.port, header(request_id, prompt="Hello there", max_tokens=1, **params))
        return thinker.engine.tokenizer.decode(tensor_of(out[0], "prompt_token_ids").tolist())

    # The request's system turn replaces the speech system prompt.
    assert await rendered("system", system_prompt="Answer briefly.") == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert await rendered("raw", raw_prompt=True) == "Hello there"


async def test_talker_and_token2wav_turn_rows_into_audio_as_a_whole_decode_would(servers):
    thinker_out = await call_stage(servers["thinker"].port, header(max_tokens=6, ignore_eos=True))
    talker_out = await call_stage(servers["talker"].port, header(max_codec_frames=40), thinker_out)
    codes = codes_of(talker_out)
    assert all(tensor_of(c, "codes").dtype == torch.int64 for c in talker_out)
    assert [tensor_of(c, "codes").shape[1] for c in talker_out] == [24, 16] and codes.shape == (1, 40)
    assert talker_out[-1].end_of_stream and talker_out[-1].finish_reason == "length"
    assert 0 <= int(codes.min()) and int(codes.max()) < CODEBOOK

    wav_out = await call_stage(servers["token2wav"].port, header(), talker_out)
    assert all(c.sample_rate == 24000 for c in wav_out) and wav_out[-1].end_of_stream
    assert len(wav_out) == len(talker_out)  # one audio chunk per codes chunk (empty while a chunk waits)
    pcm = torch.cat([tensor_of(c, "audio") for c in wav_out])
    assert len(pcm) == 40 * SAMPLES_PER_TOKEN and int(pcm.abs().max()) > 1000

    # Chunked against the whole sequence decoded at once (same seed, so the same starting noise): the
    # vocoder's chunks are exact by its receptive field, the DiT's windows are close. A different half
    # of the codes moves the audio by far more than chunking does.
    t2w = servers["token2wav"].engine.t2w

    def whole(tokens: torch.Tensor) -> torch.Tensor:
        speech = t2w.stream(t2w.voice("ethan"), seed=0)
        speech.add(tokens, ended=True)
        (_, wav), = t2w.decode_batch([speech.next_chunk()])
        return to_pcm16(wav)

    reference = whole(codes[0])
    other = codes[0].clone()
    other[20:] = torch.randint(0, CODEBOOK, (20,), generator=torch.Generator().manual_seed(1))
    assert relative_error(pcm, reference) < 1e-4
    assert relative_error(whole(other), reference) > 1e-2


async def test_talker_output_does_not_depend_on_thinker_chunking(servers):
    """The Talker takes rows one step at a time: whole-result and chunked hand-off agree."""
    thinker_out = await call_stage(servers["thinker"].port, header(max_tokens=8, ignore_eos=True))
    merged = stage_pb2.Chunk(stage="thinker", chunk_id=0, end_of_stream=True)
    for name in ("token_ids", "embeds", "hidden"):
        merged.tensors.append(tensors.to_proto(name, torch.cat([tensor_of(c, name) for c in thinker_out])))
    merged.tensors.append(tensors.to_proto("prompt_token_ids", tensor_of(thinker_out[0], "prompt_token_ids")))
    a = await call_stage(servers["talker"].port, header(max_codec_frames=20), thinker_out)
    b = await call_stage(servers["talker"].port, header(max_codec_frames=20), [merged])
    assert codes_of(a).shape[1] > 0 and torch.equal(codes_of(a), codes_of(b))


async def test_a_one_token_answer_is_spoken_too(servers):
    """No generated row reaches the Talker: its prompt ends with the text end row, then pad rows follow."""
    thinker_out = await call_stage(servers["thinker"].port, header(max_tokens=1, ignore_eos=True))
    assert len(token_ids(thinker_out)) == 1
    talker_out = await call_stage(servers["talker"].port, header(max_codec_frames=5), thinker_out)
    assert codes_of(talker_out).shape == (1, 5) and talker_out[-1].finish_reason == "length"


async def test_step_batching_gives_each_request_what_it_gets_alone(servers):
    rows = await call_stage(servers["thinker"].port, header(max_tokens=6, ignore_eos=True))
    other = await call_stage(servers["thinker"].port, header(prompt="Another one", max_tokens=9, ignore_eos=True))
    probe = (header("probe", max_codec_frames=20, temperature=0.9, seed=3), rows)
    fillers = [(header(f"f{i}", max_codec_frames=300), other) for i in range(3)]
    alone, joined = await joins_a_running_batch(servers["talker"], probe, fillers, codes_of)
    assert alone.shape[1] == 20 and torch.equal(joined, alone)

    def stream(seed: int, speaker: str = "ethan"):
        tokens = torch.randint(0, CODEBOOK, (1, 50), generator=torch.Generator().manual_seed(seed))
        return (header(f"s{seed}", seed=seed, speaker=speaker),
                [codes_chunk(0, tokens[:, :24], False), codes_chunk(1, tokens[:, 24:], True)])

    burst = [stream(10 + i, ("ethan", "chelsie")[i % 2]) for i in range(6)]
    alone, joined = await joins_a_burst(servers["token2wav"], stream(0), burst,
                                        lambda cs: [tensor_of(c, "audio") for c in cs])
    assert sum(len(a) for a in alone) == 50 * SAMPLES_PER_TOKEN
    assert all(torch.equal(a, j) for a, j in zip(alone, joined))


async def test_each_stage_reads_only_its_part_of_the_checkpoint(servers, model_dir):
    index = ShardedCheckpoint(model_dir / MODEL)
    for name in ("thinker", "talker", "token2wav"):
        stats = servers[name].engine.checkpoint.stats
        prefix = f"{name}."
        own = set(index.keys(prefix))
        borrowed = stats.keys - own
        assert own <= stats.keys, f"{name} did not read all of its part"
        files = {f.name for f in index.files(prefix)}
        if name == "talker":  # a few rows of the Thinker's embedding table, never the table
            assert borrowed == {THINKER_EMBEDDINGS}
            files.add(index.info(THINKER_EMBEDDINGS).file.name)
            rows = 2 + len(servers[name].engine.talker.speakers)  # text end, text pad, one speech start each
            extra = rows * index.info(THINKER_EMBEDDINGS).shape[1] * 4
        else:
            assert not borrowed, f"{name} read {sorted(borrowed)[:3]}"
            extra = 0
        assert stats.files == files
        headers = sum(8 + header_length(model_dir / MODEL / f) for f in files)
        assert stats.bytes == index.nbytes(prefix) + extra + headers, name  # each tensor read once, nothing else
    assert servers["talker"].engine.checkpoint.stats.bytes < index.info(THINKER_EMBEDDINGS).nbytes


async def test_bad_input_is_invalid_argument(servers):
    # refused at the header, so the header alone: a client still writing chunks when the server ends the call
    # may see gRPC's INTERNAL "Failed execute_batch" instead of the server's status
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(servers["talker"].port, header(speaker="nobody"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.audio.speaker" in e.value.details()
    assert "Chelsie, Ethan" in e.value.details()
    for bad, message in [(torch.zeros(4, 10, dtype=torch.int64), "codes must be [1, tokens]"),
                         (torch.full((1, 10), CODEBOOK, dtype=torch.int64), f"codes must lie in [0, {CODEBOOK})")]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(servers["token2wav"].port, header(), [codes_chunk(0, bad, True)])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(servers["token2wav"].port, header(speaker="nobody"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.audio.speaker" in e.value.details()
    out = await call_stage(servers["token2wav"].port, header(speaker="Chelsie"),
                           [codes_chunk(0, torch.zeros(1, 4, dtype=torch.int64), True)])
    assert len(tensor_of(out[-1], "audio")) == 4 * SAMPLES_PER_TOKEN


def test_omnistage_serve_answers_with_text_and_audio(model_dir, tmp_path):
    served = Served(MODEL, model_dir, tmp_path)
    try:
        out = tmp_path / "answer.wav"
        r = generate(served.endpoint, "--prompt", "Hello there", "--max-tokens", "8", "--max-codec-frames", "30",
                     "--out", str(out), "--return-trace")
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[0].strip(), r.stdout
        with wave.open(str(out)) as w:
            assert w.getframerate() == 24000 and w.getnchannels() == 1 and w.getsampwidth() == 2
            assert 0 < w.getnframes() <= 30 * SAMPLES_PER_TOKEN and w.getnframes() % SAMPLES_PER_TOKEN == 0
        assert "token2wav" in r.stdout
    finally:
        assert served.stop() == 0
