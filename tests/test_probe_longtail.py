"""The long tail of diffusers' IP-Adapter pipelines (#23): labels, steps and calls where the batch, the loop or the
call is not the plain ``[uncond, cond]`` one-pass-per-step shape.

Every pipeline case runs plain and probed from the same seed (outputs bit-identical) and checks the probe's table
against a float64 recomputation from the test's own forward hooks (:func:`test_probe_matrix.reference_cell`), with
the layout each pipeline gives its batch written here from diffusers' source: per item, per denoiser pass, and which
loop step each pass belongs to. The encoder readers are also checked on synthetic results (fast).
"""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch
from test_probe_matrix import check_against_reference, reference_cell

from ipa_probe.capture.branches import PromptEvidence, label_vocabulary
from ipa_probe.capture.config import DEFAULT_ROWS
from ipa_probe.capture.run import probe
from ipa_probe.layers import find_ip_layers, list_hooks
from ipa_probe.tiny.sd import tiny_ip_adapter_state_dict, tiny_pipeline
from ipa_probe.tiny.zoo import Zoo

PROMPT = "a photo of a flower"
STEPS = 2
VOCABULARY = label_vocabulary(None)

diffusers.utils.logging.set_verbosity_error()


# --------------------------------------------------------------------------- encoder results, read by shape


def _embeds(value: float, n: int = 1) -> torch.Tensor:
    return torch.full((n, 3, 4), value)


P, N, S = _embeds(1.0), _embeds(2.0), _embeds(3.0)  # prompt, negative prompt, safety concept


class FakePipeline:
    """Stands for a pipeline: its encoders return what ``results`` holds, one per call."""

    def __init__(self, *results, do_perturbed_attention_guidance: bool = False):
        self.results = list(results)
        self.do_perturbed_attention_guidance = do_perturbed_attention_guidance

    def encode_prompt(self, prompt=None, negative_prompt=None):
        return self.results.pop(0)


def _labels(evidence: PromptEvidence, *chunks: torch.Tensor) -> list[str]:
    layout = evidence.layout(torch.cat(chunks), torch.device("cpu"))
    return [VOCABULARY[i] for i in layout.items.tolist()]


def _evidence(pipe) -> PromptEvidence:
    evidence = PromptEvidence(pipe, VOCABULARY)
    evidence.install()
    return evidence


@pytest.mark.parametrize(
    "result",
    [
        (P, N),  # SD 1.5 family
        (P, N, P[:, 0], N[:, 0]),  # SDXL, SD3, Kolors
        (P, torch.zeros(3, 3), torch.ones(1, 3), N, torch.zeros(3, 3), torch.ones(1, 3)),  # Chroma
        {"prompt_embeds": P, "negative_prompt_embeds": N},
    ],
    ids=["2-tuple", "4-tuple", "6-tuple", "dict"],
)
def test_encode_prompt_results_are_read_by_shape(result):
    pipe = FakePipeline(result)
    evidence = _evidence(pipe)
    pipe.encode_prompt(PROMPT)
    assert _labels(evidence, N, P, S) == ["uncond", "cond", "batch"]
    evidence.remove()
    assert "encode_prompt" not in vars(pipe)


def test_one_prompt_per_encoding_gives_the_prompt_then_the_negative_prompt():
    """Flux's ``(prompt, pooled, text_ids)``: true CFG encodes the negative prompt in a second call."""
    pipe = FakePipeline((P, P[:, 0], torch.zeros(3, 3)), (N, N[:, 0], torch.zeros(3, 3)))
    evidence = _evidence(pipe)
    pipe.encode_prompt(PROMPT)
    pipe.encode_prompt(PROMPT)
    assert _labels(evidence, P) == ["cond"] and _labels(evidence, N) == ["uncond"]


def test_a_negative_prompt_equal_to_the_prompt_is_undecided():
    pipe = FakePipeline((P, P.clone()))
    evidence = _evidence(pipe)
    pipe.encode_prompt(PROMPT)
    assert _labels(evidence, P, P) == ["batch", "batch"]


def test_ledits_gives_its_negative_embeddings_first_and_no_prompt():
    pipe = FakePipeline((N, S, N[:, 0], S[:, 0], 3))
    evidence = _evidence(pipe)
    pipe.encode_prompt()
    assert evidence.cond is None and torch.equal(evidence.uncond, N)
    assert _labels(evidence, N, S) == ["batch", "batch"]  # no prompt to cut the batch by: undecided


class ConcatenatingPipeline:
    """InstructPix2Pix's or Safe's ``_encode_prompt``, returning the batch concatenated."""

    def __init__(self, safe: bool):
        self.safe = safe
        if safe:
            self._encode_prompt = self._safe

    def _encode_prompt(self, prompt, device, num_images_per_prompt, do_classifier_free_guidance, negative_prompt):
        return torch.cat([P, N, N]) if do_classifier_free_guidance else P

    def _safe(
        self,
        prompt,
        device,
        num_images_per_prompt,
        do_classifier_free_guidance,
        negative_prompt,
        enable_safety_guidance,
    ):
        if not do_classifier_free_guidance:
            return P
        return torch.cat([N, P, S]) if enable_safety_guidance else torch.cat([N, P])


@pytest.mark.parametrize(
    "safe, safety, batch, expected",
    [
        (False, False, (P, N, N), ["cond", "uncond_text", "uncond"]),
        (True, True, (N, P, S), ["uncond", "cond", "safety"]),
        (True, False, (N, P), ["uncond", "cond"]),
    ],
)
def test_concatenated_encodings_of_instruct_pix2pix_and_safe(safe, safety, batch, expected):
    pipe = ConcatenatingPipeline(safe)
    evidence = PromptEvidence(pipe, VOCABULARY)
    evidence.install()
    args = (PROMPT, "cpu", 1, True, None) + ((safety,) if safe else ())
    pipe._encode_prompt(*args)
    assert _labels(evidence, *batch) == expected
    evidence.remove()
    assert pipe._encode_prompt.__func__ is (
        ConcatenatingPipeline._safe if safe else ConcatenatingPipeline._encode_prompt
    )


class FreeNoisePipeline(FakePipeline):
    """AnimateDiff's FreeNoise: an outer encoder calling ``encode_prompt`` for the prompt, then for an empty prompt
    beside the negative one, and returning per-frame embeddings."""

    def _encode_prompt_free_noise(self, prompt, num_frames, cfg: bool = True):
        positive, _ = self.encode_prompt(prompt)
        empty, negative = self.encode_prompt("", "")  # would make "" the prompt if it counted
        frames_p, frames_n = positive.expand(num_frames, -1, -1), negative.expand(num_frames, -1, -1)
        return (torch.cat([frames_n, frames_p]), frames_n) if cfg else (frames_p, None)


@pytest.mark.parametrize("cfg", [True, False])
def test_freenoise_keeps_the_outer_encoders_per_frame_embeddings(cfg):
    empty = _embeds(9.0)
    pipe = FreeNoisePipeline((P, None), (empty, N))
    evidence = _evidence(pipe)
    frames = 3
    embeds, _ = pipe._encode_prompt_free_noise(PROMPT, frames, cfg)
    expected = ["uncond"] * frames + ["cond"] * frames if cfg else ["cond"] * frames
    assert _labels(evidence, embeds) == expected
    assert evidence._depth == 0


@pytest.mark.parametrize("frames", [1, 3])
@pytest.mark.parametrize("cfg", [True, False])
def test_pag_perturbed_items_are_the_last_part_also_when_repeated_per_frame(cfg, frames):
    pipe = FakePipeline((P, N if cfg else None), do_perturbed_attention_guidance=True)
    evidence = _evidence(pipe)
    pipe.encode_prompt(PROMPT)
    parts = ([N] if cfg else []) + [P, P]  # diffusers' PAG batch, then AnimateDiff's repeat_interleave per frame
    context = torch.cat(parts).repeat_interleave(frames, dim=0)
    labels = ([["uncond"]] if cfg else []) + [["cond"], ["perturbed"]]
    assert _labels(evidence, context) == [label for part in labels for label in part * frames]


# --------------------------------------------------------------------------- the test's own hooks


class PassRecorder:
    """Forward hooks on one IP-Adapter layer: per denoiser pass of its attention, the query the image branch uses
    and the image keys of adapter 0 (``(B, H, Q, D)`` and ``(B, H, K, D)``, float64 numpy)."""

    def __init__(self, layer, query_module=None, split_query=True):
        self.heads = layer.heads
        self.passes: list[dict] = []
        self.split_query = split_query
        query_module = query_module if query_module is not None else layer.attention.to_q
        to_k_ip = layer.processor.to_k_ip
        self.handles = [
            layer.attention.register_forward_pre_hook(lambda m, a: self.passes.append({"keys": []})),
            query_module.register_forward_hook(self._query),
            (to_k_ip[0] if isinstance(to_k_ip, torch.nn.ModuleList) else to_k_ip).register_forward_hook(self._keys),
        ]

    def _query(self, module, args, output):
        q = output.detach().double().numpy().copy()
        if self.split_query:  # (B, Q, H * D) -> (B, H, Q, D)
            q = q.reshape(q.shape[0], q.shape[1], self.heads, -1).transpose(0, 2, 1, 3)
        else:  # Flux's norm_q output: (B, Q, H, D) -> (B, H, Q, D)
            q = q.transpose(0, 2, 1, 3)
        self.passes[-1]["q"] = q

    def _keys(self, module, args, output):
        k = output.detach().double().numpy().copy()
        batch, heads, _, d = self.passes[-1]["q"].shape
        self.passes[-1]["keys"].append(k.reshape(batch, -1, heads, d).transpose(0, 2, 1, 3))  # (B, H, K, D)

    def remove(self):
        for handle in self.handles:
            handle.remove()


def expected_table(passes: list[dict], plan: list[tuple[int, list[str]]]) -> dict:
    """``(step, label) -> statistics per head``: per batch item of every pass, at the step ``plan`` gives the pass,
    averaged over the label's items of all the step's passes."""
    cells: dict[tuple[int, str], list[dict]] = {}
    for record, (step, items) in zip(passes, plan, strict=True):
        assert len(items) == record["q"].shape[0], "the plan names every batch item"
        for keys in record["keys"]:
            for item, label in enumerate(items):
                part = slice(item, item + 1)
                cells.setdefault((step, label), []).append(reference_cell(record["q"][part], keys[part], None))
    return {key: {n: np.mean([c[n] for c in group], axis=0) for n in group[0]} for key, group in cells.items()}


def _generate(pipe, refs, **kwargs):
    kwargs = {
        "prompt": PROMPT,
        "ip_adapter_image": [refs],
        "num_inference_steps": STEPS,
        "output_type": "np",
        **kwargs,
    }
    return pipe(generator=torch.Generator().manual_seed(0), return_dict=False, **kwargs)[0]


def probed_against_hooks(
    pipe, refs, layer_pattern=None, query_module=None, split_query=True, rows=DEFAULT_ROWS, **kwargs
):
    """Plain, then probed with the test's own hooks on one layer: ``(table, passes)``; outputs bit-identical."""
    plain = _generate(pipe, refs, **kwargs)
    layer = find_ip_layers(pipe, layer_pattern)[0]
    recorder = PassRecorder(layer, query_module(layer) if query_module else None, split_query)
    try:
        with probe(pipe, layers=f"^{layer.name}$", rows=rows) as run:
            probed = _generate(pipe, refs, **kwargs)
    finally:
        recorder.remove()
    assert np.array_equal(np.asarray(plain), np.asarray(probed))
    return run.to_dataframe(), recorder.passes, layer


@pytest.fixture(scope="module")
def zoo():
    return Zoo()


# --------------------------------------------------------------------------- the pipelines


@pytest.mark.slow
def test_animatediff_pag_repeats_every_part_per_frame(zoo, refs):
    pipe = zoo.build("AnimateDiffPAGPipeline").pipe
    frames = 3
    df, passes, layer = probed_against_hooks(pipe, refs, num_frames=frames, pag_scale=3.0, negative_prompt="blurry")
    items = ["uncond"] * frames + ["cond"] * frames + ["perturbed"] * frames
    check_against_reference(df, expected_table(passes, [(step, items) for step in range(STEPS)]), layer.heads)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [True, False])
def test_sag_degraded_pass_is_its_own_label_at_its_step(zoo, refs, cfg):
    pipe = zoo.build("StableDiffusionSAGPipeline").pipe
    kwargs = {"negative_prompt": "blurry"} if cfg else {"guidance_scale": 1.0}
    df, passes, layer = probed_against_hooks(pipe, refs, sag_scale=0.75, **kwargs)
    loop = ["uncond", "cond"] if cfg else ["cond"]
    plan = [(step, labels) for step in range(STEPS) for labels in (loop, ["sag"])]  # the degraded pass: 1 item
    check_against_reference(df, expected_table(passes, plan), layer.heads)
    assert df["call"].unique().tolist() == [0]
    timesteps = df.groupby("step")["timestep"].first().tolist()
    assert timesteps == pipe.scheduler.timesteps.tolist()  # the loop's timesteps, one step each


@pytest.fixture
def device_timesteps(monkeypatch):
    """The clock as it runs on an accelerator: a pass's timestep value is never read (it would sync)."""
    import ipa_probe.capture.clock as clock

    monkeypatch.setattr(clock, "host_timestep", lambda timestep: None)


@pytest.mark.slow
@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_panorama_views_are_passes_of_one_step_in_one_call(zoo, refs, on_device, request):
    if on_device:
        request.getfixturevalue("device_timesteps")
    pipe = zoo.build("StableDiffusionPanoramaPipeline").pipe
    # 64 x 64 views: 4,096 query rows per cell, which the default samples; the comparison with the hooks is exact
    df, passes, layer = probed_against_hooks(pipe, refs, rows=None, height=512, width=576, output_type="latent")
    views = len(passes) // STEPS
    assert views == 2
    plan = [(step, ["uncond", "cond"]) for step in range(STEPS) for _ in range(views)]
    check_against_reference(df, expected_table(passes, plan), layer.heads)
    assert df["call"].unique().tolist() == [0]


@pytest.mark.slow
def test_from_pipe_sibling_with_its_own_scheduler_has_its_own_calls(refs):
    pipe = tiny_pipeline("sd15")
    scheduler = diffusers.EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    sibling = diffusers.StableDiffusionPipeline.from_pipe(pipe, scheduler=scheduler)
    sibling.set_progress_bar_config(disable=True)
    with probe(pipe) as run:
        for _ in range(3):
            _generate(sibling, refs, output_type="latent")
    df = run.to_dataframe()
    assert sorted(df["call"].unique()) == [0, 1, 2]
    for _, call in df.groupby("call"):
        assert call.groupby("step")["timestep"].first().tolist() == scheduler.timesteps.tolist()
    assert pipe.scheduler.timesteps is None or not torch.equal(pipe.scheduler.timesteps, scheduler.timesteps)


class _TwiceOverLoop(diffusers.StableDiffusionPipeline):
    """A pipeline whose ``__call__`` runs its loop twice over the same ``timesteps`` tensor, sets no
    ``_num_timesteps`` and starts its schedule at ``begin``: the clock's evidence is the pass, not these locals."""

    def __call__(self, latents, context, image_embeds, begin=0):
        self.scheduler.set_timesteps(4)
        self.scheduler.set_begin_index(begin)
        timesteps = self.scheduler.timesteps[begin:]
        for _ in range(2):
            for t in timesteps:
                self.unet(latents, t, encoder_hidden_states=context, added_cond_kwargs={"image_embeds": image_embeds})


def test_the_clock_reads_calls_from_the_passes_not_the_loops_locals(sd15, refs):
    """One ``__call__`` running its loop twice over one ``timesteps`` local is two calls (the timestep rises); the
    planned steps come from the scheduler past its ``begin_index`` when the pipeline sets no ``_num_timesteps``."""
    from ipa_probe.capture import spine

    scheduler = diffusers.EulerDiscreteScheduler.from_config(sd15.scheduler.config)  # one with a begin_index
    pipe = _TwiceOverLoop(**{**sd15.components, "scheduler": scheduler})
    image_embeds = sd15.prepare_ip_adapter_image_embeds([refs], None, "cpu", 1, False)
    context, _ = sd15.encode_prompt(PROMPT, "cpu", 1, False)
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    planned = []
    watcher = spine.client(on_pass=lambda core, *_: core.now.new_call and planned.append(core.planned_steps()))
    with probe(pipe) as run:
        assert spine.attach(pipe, watcher) is spine.spine_of(pipe)  # the probe's spine, shared by the watcher
        try:
            pipe(latents, context, image_embeds, begin=1)
        finally:
            spine.detach(pipe, watcher)
    df = run.to_dataframe()
    timesteps = pipe.scheduler.timesteps[1:].tolist()
    assert sorted(df["call"].unique()) == [0, 1]
    for _, call in df.groupby("call"):
        assert call.groupby("step")["timestep"].first().tolist() == timesteps
    assert planned == [3, 3]  # 4 scheduler timesteps past begin_index 1


def test_planned_steps_are_the_pipelines_own_count(sd15, refs):
    """img2img runs ``strength`` of the schedule: the planned steps are its ``_num_timesteps``, not the scheduler's."""
    from ipa_probe.capture import spine

    pipe = diffusers.StableDiffusionImg2ImgPipeline.from_pipe(sd15)
    pipe.set_progress_bar_config(disable=True)
    planned = []
    watcher = spine.client(on_pass=lambda core, *_: core.now.new_call and planned.append(core.planned_steps()))
    spine.attach(pipe, watcher)
    try:
        pipe(
            prompt=PROMPT,
            image=torch.zeros(1, 3, 64, 64),
            ip_adapter_image=[refs],
            strength=0.5,
            num_inference_steps=4,
            output_type="latent",
        )
    finally:
        spine.detach(pipe, watcher)
    assert planned == [pipe.num_timesteps] == [2]  # half of 4 steps
    assert len(pipe.scheduler.timesteps) == 4


def test_a_loop_repeating_a_timestep_value_counts_each_iteration(sd15, refs):
    """A second-order scheduler passes the same value twice as new tensors: two steps; the very same tensor is a
    further pass of one step."""
    image_embeds = sd15.prepare_ip_adapter_image_embeds([refs], None, "cpu", 1, False)
    context, _ = sd15.encode_prompt(PROMPT, "cpu", 1, False)
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor(500)
    with probe(sd15) as run:
        for timestep in (t, t, torch.tensor(500), torch.tensor(300)):
            sd15.unet(
                latents, timestep, encoder_hidden_states=context, added_cond_kwargs={"image_embeds": image_embeds}
            )
    df = run.to_dataframe()
    assert df.groupby("step")["timestep"].first().tolist() == [500, 500, 300]


@pytest.mark.slow
@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_freeinit_iterations_restart_the_loop_as_calls(zoo, refs, on_device, request):
    """FreeInit re-runs the loop inside one ``__call__``: the timestep rises (on the host), or the loop's timesteps
    are a new tensor (on a device, where the value is not read)."""
    if on_device:
        request.getfixturevalue("device_timesteps")
    pipe = zoo.build("AnimateDiffPipeline").pipe
    pipe.enable_free_init(num_iters=2)
    with probe(pipe) as run:
        _generate(pipe, refs, num_frames=2, output_type="latent")
    df = run.to_dataframe()
    assert sorted(df["call"].unique()) == [0, 1]
    assert all(sorted(call["step"].unique()) == [0, 1] for _, call in df.groupby("call"))


@pytest.mark.slow
def test_freenoise_frames_are_labelled_from_the_interpolated_embeddings(zoo, refs):
    pipe = zoo.build("AnimateDiffPipeline").pipe
    pipe.enable_free_noise(context_length=2, context_stride=1)
    frames = 3
    prompts = {0: PROMPT, 2: "a photo of a cat"}  # interpolated per frame: neither prompt's embeddings
    df, passes, layer = probed_against_hooks(pipe, refs, prompt=prompts, num_frames=frames, output_type="latent")
    items = ["uncond"] * frames + ["cond"] * frames
    check_against_reference(df, expected_table(passes, [(s, items) for s in range(STEPS)]), layer.heads)


@pytest.mark.slow
def test_safe_pipeline_labels_its_safety_concept(zoo, refs):
    pipe = zoo.build("StableDiffusionPipelineSafe").pipe
    kwargs = {"ip_adapter_image": refs[0], "negative_prompt": "blurry", "sld_guidance_scale": 1000.0}
    df, passes, layer = probed_against_hooks(pipe, refs, **kwargs)
    plan = [(s, ["uncond", "cond", "safety"]) for s in range(STEPS)]
    check_against_reference(df, expected_table(passes, plan), layer.heads)


@pytest.mark.slow
def test_chroma_negative_pass_is_uncond(zoo, refs):
    pipe = zoo.build("ChromaPipeline").pipe
    kwargs = {
        "negative_prompt": "blurry",
        "guidance_scale": 4.0,
        "height": 64,
        "width": 64,
        "max_sequence_length": 16,
        "output_type": "latent",
    }
    df, passes, layer = probed_against_hooks(
        pipe, refs, r"blocks\.1\.", lambda layer: layer.attention.norm_q, False, **kwargs
    )
    plan = [(step, [label]) for step in range(STEPS) for label in ("cond", "uncond")]  # the prompt's pass first
    check_against_reference(df, expected_table(passes, plan), layer.heads)


# --------------------------------------------------------------------------- adapters replaced inside the block


def _load(pipe, seed, adapters=1):
    states = [tiny_ip_adapter_state_dict(pipe.unet, pipe.image_encoder, seed=seed + i) for i in range(adapters)]
    pipe.load_ip_adapter(
        states,
        subfolder=[""] * adapters,
        weight_name=[""] * adapters,
        image_encoder_folder=None,
        low_cpu_mem_usage=False,
    )


def test_load_ip_adapter_inside_the_block_is_followed(refs):
    plain_pipe = tiny_pipeline("sd15")
    plain = [_generate(plain_pipe, refs)]
    _load(plain_pipe, seed=5)
    plain.append(_generate(plain_pipe, refs))

    pipe = tiny_pipeline("sd15")
    layer = find_ip_layers(pipe)[0]
    with probe(pipe, layers=f"^{layer.name}$") as run:
        first = _generate(pipe, refs)
        _load(pipe, seed=5)
        new_layer = find_ip_layers(pipe, f"^{layer.name}$")[0]
        assert new_layer.processor is not layer.processor
        recorder = PassRecorder(new_layer)
        second = _generate(pipe, refs)
        recorder.remove()
    assert np.array_equal(first, plain[0]) and np.array_equal(second, plain[1])
    assert not np.array_equal(plain[0], plain[1])  # the new adapter's weights differ
    df = run.to_dataframe()
    assert sorted(df["call"].unique()) == [0, 1]
    expected = expected_table(recorder.passes, [(s, ["uncond", "cond"]) for s in range(STEPS)])
    check_against_reference(df[df["call"] == 1], expected, layer.heads)
    assert list_hooks(pipe) == []


def test_load_ip_adapter_changing_the_adapters_inside_the_block_is_refused(refs):
    pipe = tiny_pipeline("sd15")
    with pytest.raises(RuntimeError, match="load_ip_adapter"):
        with probe(pipe) as run:
            _generate(pipe, refs)
            _load(pipe, seed=5, adapters=2)
            pipe(prompt=PROMPT, ip_adapter_image=[refs, refs], num_inference_steps=STEPS, output_type="latent")
    assert list_hooks(pipe) == []
    assert run.to_dataframe()["call"].unique().tolist() == [0]  # what was recorded before is kept
    layer = find_ip_layers(pipe)[0]
    assert all(not module._forward_hooks for module in layer.processor.to_k_ip)
