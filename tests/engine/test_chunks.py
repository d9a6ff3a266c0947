"""engine/chunks.py: the one SamplingSpec built from SamplingParams, and a request's chunk of a step."""

from __future__ import annotations

import dataclasses

import torch

from tailserve.engine.chunks import PARAMS_FIELDS, sampling_spec, seq_chunk
from tailserve.engine.request import Request, RequestTimings, SamplingParams
from tailserve.model.sampler import SamplingSpec

# What the engine adds to a request's settings each step; every other field comes from SamplingParams.
ENGINE_FIELDS = {"generator", "banned_token_ids", "token_ids", "num_prompt_tokens", "token_bitmask"}


def _request(params: SamplingParams, prompt: list[int], generated: tuple[int, ...] = ()) -> Request:
    req = Request("r", prompt, params, RequestTimings(0.0), seq_no=0, generator=torch.Generator())
    req.token_ids.extend(generated)
    return req


def test_every_spec_setting_comes_from_the_params_under_its_name_and_default() -> None:
    spec_fields = {f.name: f for f in dataclasses.fields(SamplingSpec)}
    params_fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    assert set(spec_fields) == set(PARAMS_FIELDS) | ENGINE_FIELDS
    assert list(spec_fields)[: len(PARAMS_FIELDS)] == list(PARAMS_FIELDS)  # they go in by position
    assert {"temperature", "top_p", "top_k", "logit_bias", "logprobs"} <= set(PARAMS_FIELDS)
    for name in PARAMS_FIELDS:
        assert spec_fields[name].default == params_fields[name].default, name
    assert SamplingSpec().temperature == SamplingParams().temperature == 1.0


def test_a_request_spec_carries_its_settings_and_what_the_engine_adds() -> None:
    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.2, logit_bias={7: 2.0, 3: -1.0}, logprobs=2, stop_token_ids=(9,),
        min_tokens=2, max_tokens=8,
    )  # fmt: skip
    req = _request(params, [1, 2, 3], [4])
    mask = torch.zeros(1, dtype=torch.int32)
    spec = sampling_spec(req, eos_ids=[0], bitmask=mask)
    for name in PARAMS_FIELDS:
        assert getattr(spec, name) == getattr(params, name), name
    assert spec.logit_bias == ((7, 2.0), (3, -1.0))
    assert spec.generator is req.generator and spec.token_bitmask is mask
    assert list(spec.token_ids) == [1, 2, 3, 4] and spec.num_prompt_tokens == 3
    assert set(spec.banned_token_ids) == {9, 0}  # one output token < min_tokens: stop and end tokens banned
    req.token_ids.append(5)
    assert sampling_spec(req, eos_ids=[0], bitmask=None).banned_token_ids == ()


def test_a_chunk_samples_only_when_it_reaches_the_last_known_token() -> None:
    req = _request(SamplingParams(temperature=0.0), list(range(10, 20)))
    first = seq_chunk(req, 6, [0], False, [0], None)
    req.num_computed_tokens = 6
    rest = seq_chunk(req, 4, [0], False, [0], None)
    assert (first.token_ids, first.sample) == (list(range(10, 16)), False)
    assert (rest.token_ids, rest.start_pos, rest.sample) == (list(range(16, 20)), 6, True)
    assert rest.sampling.temperature == 0.0


def test_a_repeated_logit_bias_token_keeps_its_last_bias() -> None:
    assert SamplingParams(logit_bias=((5, 1.0), (6, 2.0), (5, -3.0))).logit_bias == ((5, -3.0), (6, 2.0))
