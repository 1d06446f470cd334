"""Reasons stay short whatever a request names: many GPU models (up to 32 of 200
characters each) are named three at a time and counted. Pure, no I/O."""

from __future__ import annotations

from gpusched.admission.catalog import Catalog
from gpusched.admission.words import models_words, some_of
from gpusched.contracts.messages import GpuRequest, SubmitJob
from gpusched.domain.inventory import parse_inventory

CATALOG = Catalog(
    parse_inventory(
        {
            "nodes": [
                {"name": "shared-00", "pool": "shared", "gpu_model": "A100-80GB", "gpus": 4,
                 "cpu_milli": 64000, "memory_mib": 524288},
            ]
        }
    )
)  # fmt: skip
MADE_UP = [f"X{number:02d}" + "y" * 190 for number in range(31)]


def submit(count: int, models: list[str]) -> SubmitJob:
    return SubmitJob(name="j", team="vision", gpus=GpuRequest(count=count, models=models))


def test_a_few_items_are_all_named_and_many_are_named_three_and_counted() -> None:
    assert some_of(["a", "b", "c"]) == "a, b, c"
    assert some_of(["a", "b", "c", "d", "e"]) == "a, b, c and 2 more"
    assert some_of(["a", "b"], " or ") == "a or b"
    assert some_of(["a", "b", "c"], most=1) == "a and 2 more"
    assert models_words([]) == "any model"
    assert models_words(["A", "B"]) == "A|B"
    assert models_words(["A", "B", "C", "D"]) == "any of 4 models (A, B, C and 1 more)"


def test_a_refusal_of_many_unknown_models_names_three_and_counts_the_rest() -> None:
    refusal = CATALOG.refusal(submit(1, [*MADE_UP, "Z" * 190]))

    assert refusal is not None and refusal.code == "unknown_gpu_model"
    assert "and 29 more not in the inventory (known: A100-80GB)" in refusal.message
    assert len(refusal.message) < 1_000


def test_an_ask_no_pool_could_ever_give_describes_its_many_models_briefly() -> None:
    refusal = CATALOG.refusal(submit(16, ["A100-80GB", *MADE_UP]))

    assert refusal is not None and refusal.code == "unsatisfiable"
    assert "asks 16 GPUs (any of 32 models (A100-80GB, X00" in refusal.message
    assert "and 29 more)" in refusal.message
    assert len(refusal.message) < 1_000
