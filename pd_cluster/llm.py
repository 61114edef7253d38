"""Offline batch generation, shaped like the API users know from vLLM."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from pd_cluster.config import EngineConfig
from pd_cluster.engine.beam_search import BeamResult
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import RequestOutput
from pd_cluster.engine.request import Request
from pd_cluster.generation_defaults import generation_defaults
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


class LLM:
    """``LLM(model="default").generate(prompts, SamplingParams(...))``.

    String prompts are tokenized as they are (no chat template; use
    :meth:`apply_chat_template` first for chat models); token-id lists are used directly.
    Extra keyword arguments are :class:`EngineConfig` fields.
    """

    def __init__(self, model: str = "default", **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if any."""
        self.engine.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return None, [int(t) for t in prompt]

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams) -> list[BeamResult]:
        """Run a beam search (``params.use_beam_search``) for every prompt, all submitted at once;
        results in order, each beam's ``text`` decoded."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = [f"beam-{next(self._ids)}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts):
            self.engine.add_beam_request(request_id, self._encode(prompt)[1], params)  # type: ignore[arg-type]
        while self.engine.has_unfinished():
            self.engine.step()
        results = {r.request_id: r for r in self.engine.take_beam_results()}
        for result in results.values():
            for beam in result.beams:
                beam.text = self.tokenizer.decode(beam.token_ids, skip_special_tokens=params.skip_special_tokens)
        return [results[request_id] for request_id in ids]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion (all submitted at once) and return results in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams(**generation_defaults(self.engine.model_path))
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params: need one per prompt, or a single one for all")
        texts_and_ids = [self._encode(p) for p in prompts]
        for (_, ids), params in zip(texts_and_ids, params_list):
            self.engine.validate(ids, params)
        requests: list[Request] = []
        for (_, ids), params in zip(texts_and_ids, params_list):
            requests.append(self.engine.add_request(f"offline-{next(self._ids)}", ids, params))
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(requests), desc="generating", unit="req")
        while self.engine.has_unfinished():
            for update in self.engine.step():
                if update.finish_reason is not None and progress is not None:
                    progress.update()
        if progress is not None:
            progress.close()
        return [
            RequestOutput(
                request_id=req.request_id,
                prompt=text,
                prompt_token_ids=req.prompt_token_ids,
                token_ids=list(req.output_token_ids),
                text=req.output.text,
                finish_reason=req.finish_reason,
                stop_reason=getattr(req.output, "stop_reason", None),
                num_cached_tokens=req.num_cached_tokens,
                logprobs=req.logprobs if req.sampling.params.logprobs is not None else None,
                num_preemptions=req.num_preemptions,
                prompt_logprobs=req.prompt_logprobs.result() if req.prompt_logprobs is not None else None,
            )
            for (text, _), req in zip(texts_and_ids, requests)
        ]
