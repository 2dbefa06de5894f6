"""Threads where they pay (car_fl.training.train): one torch thread for a loop of small steps,
the default otherwise, and the caller's setting back afterwards; head-only epochs take it,
encoder passes do not."""

from __future__ import annotations

import torch

from car_fl.model.features import LocalData
from car_fl.model.retriever import build_retriever
from car_fl.training.train import (
    SMALL_STEP,
    head_work,
    make_optimizer,
    step_multiply_adds,
    threads_for,
    train_epoch,
)


def test_small_steps_run_on_one_thread_and_the_setting_is_restored() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with threads_for(SMALL_STEP - 1) as used:
            assert used == 1 == torch.get_num_threads()
        assert torch.get_num_threads() == 2
        with threads_for(SMALL_STEP) as used:
            assert used == 2 == torch.get_num_threads()
        try:
            with threads_for(1):
                raise RuntimeError("a failing step")
        except RuntimeError:
            pass
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_head_only_epoch_steps_on_one_thread_and_an_encoder_pass_counts_as_large(
    make_settings,
) -> None:
    settings = make_settings()
    model = build_retriever(settings, 2, hidden_size=384)  # MiniLM on SMS: 770 parameters
    features = torch.randn(16, 384)
    assert step_multiply_adds(model, features, 4) == head_work(770 + 384 * 2, 4) < SMALL_STEP
    assert step_multiply_adds(model, None, 4) >= SMALL_STEP
    seen: list[int] = []
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        data = LocalData(features=features, labels=torch.tensor([0, 1] * 8))
        optimizer = make_optimizer(model, settings.train)
        train_epoch(
            model,
            data,
            optimizer,
            batch_size=4,
            seed=0,
            epoch=0,
            progress=False,
            after_step=lambda _: seen.append(torch.get_num_threads()),
        )
        assert seen == [1, 1, 1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
