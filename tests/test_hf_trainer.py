"""TwinFlowAdam under Hugging Face's Trainer (through accelerate), against torch.optim.AdamW, on the CPU.

A tiny OPT (2 layers, hidden 32, vocab 128), random init with a fixed seed,
trained 10 steps on random token ids (labels = input_ids) with a constant LR.
The Trainer drives the optimizer as it drives AdamW: it wraps it in
accelerate's AcceleratedOptimizer, clips with torch.nn.utils.clip_grad_norm_
when ``max_grad_norm > 0``, calls ``model.zero_grad()``, and checkpoints with
``torch.save(optimizer.state_dict())`` / ``load_state_dict(torch.load(...,
weights_only=True))``.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from twinflow import TwinFlowAdam  # noqa: E402

LR = 1e-3
STEPS = 10


def make_model(seed: int = 0) -> torch.nn.Module:
    config = transformers.OPTConfig(
        vocab_size=128,
        hidden_size=32,
        word_embed_proj_dim=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=64,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        layerdrop=0.0,
    )
    torch.manual_seed(seed)
    model = transformers.OPTForCausalLM(config).float().train()
    # The attention's softmax cancels a key bias, so its gradient is mathematically zero: what backward gives is
    # the matmuls' rounding noise, which differs with the BLAS and the CPU, and which Adam normalises into steps
    # of any size up to lr. Frozen, they leave every compared weight a function of real gradients.
    for name, p in model.named_parameters():
        if name.endswith("k_proj.bias"):
            p.requires_grad_(False)
    return model


def dataset(n: int = 4 * STEPS, seq_len: int = 16) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, 128, (seq_len,), generator=gen)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return rows


def args(output_dir, max_grad_norm: float, **overrides) -> transformers.TrainingArguments:
    kwargs = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=LR,
        weight_decay=0.0,
        max_grad_norm=max_grad_norm,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        lr_scheduler_type="constant",
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def trainer_for(model, optimizer, output_dir, max_grad_norm: float, **overrides) -> transformers.Trainer:
    return transformers.Trainer(
        model=model,
        args=args(output_dir, max_grad_norm, **overrides),
        train_dataset=dataset(),
        optimizers=(optimizer, None),
    )


def history(trainer: transformers.Trainer, key: str) -> dict[int, float]:
    return {entry["step"]: entry[key] for entry in trainer.state.log_history if key in entry}


def final_weights(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    if isinstance(optimizer, TwinFlowAdam):
        optimizer.synchronize()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def twinflow(model: torch.nn.Module, attach: bool, release_grads: bool = True, **kwargs) -> TwinFlowAdam:
    opt = TwinFlowAdam(model.parameters(), lr=LR, weight_decay=0.0, ratio=0.5, **kwargs)
    if attach:
        opt.attach(model, release_grads=release_grads)
    return opt


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """torch.optim.AdamW, with the Trainer clipping at 1.0."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    trainer = trainer_for(model, opt, tmp_path_factory.mktemp("baseline"), max_grad_norm=1.0)
    trainer.train()
    losses, norms = history(trainer, "loss"), history(trainer, "grad_norm")
    assert sorted(losses) == list(range(1, STEPS + 1))
    # clipping at 1.0 is active in most steps: a run that does not clip (or clips half the gradients) shows
    assert sum(n > 1.0 for n in norms.values()) >= STEPS // 2, norms
    return losses, final_weights(model, opt)


def assert_same_run(losses, weights, baseline, loss_tol: float = 1e-5) -> None:
    ref_losses, ref_weights = baseline
    assert sorted(losses) == sorted(ref_losses)
    for step in ref_losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=loss_tol, abs=loss_tol), f"step {step}"
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_documented_recipe_matches_adamw(baseline, tmp_path) -> None:
    """README's recipe: TwinFlowAdam(max_grad_norm=1.0) attached with release_grads=False (the Trainer's logged
    norm, clip_grad_norm_ with max_norm=inf, then sees every gradient), the Trainer not clipping."""
    model = make_model()
    opt = twinflow(model, attach=True, release_grads=False, max_grad_norm=1.0)
    trainer = trainer_for(model, opt, tmp_path, max_grad_norm=0.0)
    trainer.train()
    assert_same_run(history(trainer, "loss"), final_weights(model, opt), baseline)


def test_unattached_with_trainer_clipping_matches_adamw(baseline, tmp_path) -> None:
    """Not attached: a plain drop-in, the Trainer clips with torch.nn.utils.clip_grad_norm_."""
    model = make_model()
    opt = twinflow(model, attach=False)
    trainer = trainer_for(model, opt, tmp_path, max_grad_norm=1.0)
    trainer.train()
    assert_same_run(history(trainer, "loss"), final_weights(model, opt), baseline)


def test_attached_with_trainer_clipping_matches_or_refuses(baseline, tmp_path) -> None:
    """Attached and the Trainer clipping after backward: AdamW's run, or a clear error before the first step
    completes -- never a silently different run."""
    model = make_model()
    opt = twinflow(model, attach=True)
    trainer = trainer_for(model, opt, tmp_path, max_grad_norm=1.0)
    try:
        trainer.train()
    except RuntimeError as e:
        assert trainer.state.global_step == 0, f"refused only after {trainer.state.global_step} steps went through"
        assert "clip" in str(e).lower(), str(e)
        return
    assert_same_run(history(trainer, "loss"), final_weights(model, opt), baseline)


@pytest.mark.parametrize("attach", [True, False], ids=["attached", "plain"])
def test_resume_from_checkpoint_is_bit_identical(tmp_path, attach: bool) -> None:
    """10 steps saving at step 5; a new Trainer (new model, new optimizer) resumes from checkpoint-5 to step 10:
    steps 6-10 and the final weights are identical to the uninterrupted run."""

    def optimizer(model):
        return twinflow(model, attach=attach, release_grads=False, max_grad_norm=1.0)

    model = make_model()
    opt = optimizer(model)
    overrides = dict(save_strategy="steps", save_steps=5)
    full = trainer_for(model, opt, tmp_path, max_grad_norm=0.0, **overrides)
    full.train()
    full_losses, full_weights = history(full, "loss"), final_weights(model, opt)
    checkpoint = os.path.join(tmp_path, "checkpoint-5")
    assert os.path.isfile(os.path.join(checkpoint, "optimizer.pt"))

    model2 = make_model(seed=1)  # other initial weights: everything must come from the checkpoint
    opt2 = optimizer(model2)
    resumed = trainer_for(model2, opt2, tmp_path, max_grad_norm=0.0, **overrides)
    resumed.train(resume_from_checkpoint=checkpoint)
    resumed_losses = history(resumed, "loss")
    assert [s for s in resumed_losses if s > 5] == list(range(6, STEPS + 1))
    for step in range(6, STEPS + 1):
        assert resumed_losses[step] == full_losses[step], f"step {step}"
    for name, w in final_weights(model2, opt2).items():
        assert torch.equal(w, full_weights[name]), name
