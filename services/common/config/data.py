"""The `data` section: training and evaluation datasets."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from kuberl.common.config.base import Section


class ColumnsConfig(Section):
    prompt: str = "prompt"
    answer: str = "answer"
    metadata: list[str] = Field(
        default_factory=list, description="Columns kept as metadata; empty keeps every other one."
    )


#: Local files read as they are; anything else of a file's shape is refused at once.
DATA_FILE_SUFFIXES = (".jsonl", ".ndjson", ".parquet")
OTHER_FILE_SUFFIXES = (".json", ".csv", ".tsv", ".txt", ".arrow", ".yaml", ".yml", ".gz", ".zip")


class DatasetConfig(Section):
    path: str = Field(
        description="A .jsonl or .parquet file, a folder saved by `datasets` (`save_to_disk`) "
        "or holding data files, or a Hugging Face hub dataset id (`openai/gsm8k`), fetched "
        "once into the HF cache and read with `datasets` (`subset`, `split`)."
    )
    name: str | None = Field(None, description="Name in the job; defaults to the file stem.")
    subset: str | None = Field(
        None, description="The dataset's configuration (`main` of openai/gsm8k), if it has several."
    )
    split: str = Field("train", description="Split of a folder or hub dataset.")
    revision: str | None = Field(None, description="Branch, tag or commit of a hub dataset.")
    columns: ColumnsConfig = Field(default_factory=ColumnsConfig)
    limit: int = Field(0, ge=0, description="Use only the first N rows (0 = all).")
    verifiers: dict[str, float] | None = Field(
        None, description="Reward verifiers and weights for this dataset (default: reward's)."
    )

    @field_validator("path")
    @classmethod
    def _readable_format(cls, value: str) -> str:
        if value.lower().endswith(OTHER_FILE_SUFFIXES):
            raise ValueError(
                f"{value}: unsupported dataset format; give a .jsonl or .parquet file, a folder "
                "saved by `datasets` (save_to_disk) or a hub dataset id such as openai/gsm8k"
            )
        return value


class DataConfig(Section):
    train: list[DatasetConfig] = Field(default_factory=list)
    eval: list[DatasetConfig] = Field(default_factory=list)
    num_epochs: int = Field(1, ge=1, description="Passes over the training prompts.")

    @model_validator(mode="after")
    def _unique_names(self) -> DataConfig:
        """The buffer keeps one dataset per name (its file stem unless `name` is set), so a
        second dataset of the same name would never be loaded."""
        seen: dict[str, str] = {}
        for kind, datasets in (("train", self.train), ("eval", self.eval)):
            for i, d in enumerate(datasets):
                name, where = d.name or Path(d.path).stem, f"data.{kind}[{i}] ({d.path})"
                if name in seen:
                    raise ValueError(
                        f"{where} and {seen[name]} are both named {name!r}: give one of them a "
                        "`name` (dataset names must be unique across train and eval)"
                    )
                seen[name] = where
        return self
