"""Sentence embeddings on the device, for POST /v1/embeddings.

The bundled model is all-MiniLM-L6-v2, a sentence-transformers model (BERT, 6 layers, 384 dimensions), shipped as
a zipped folder whose sha256 deploy/models.py verifies. It runs with transformers on a thread of its own (never the
event loop), with the model's own recipe (its modules.json): the transformer, mean pooling over the real tokens,
then L2 normalisation. Inputs longer than the model's window (256 tokens) are truncated, as sentence-transformers
does; usage counts the tokens actually embedded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class SentenceEmbedder:
    def __init__(self, model_id: str, zip_path: Path, max_tokens: int = 256) -> None:
        self.model_id = model_id
        self.zip_path = Path(zip_path)
        self.max_tokens = max_tokens
        self.dimensions: int | None = None
        self._model = None
        self._tokenizer = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embeddings")

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def ready(self) -> bool:
        return self._model is not None

    def _folder(self) -> Path:
        """The zip's files, unpacked once beside it (the zip itself is the verified artifact)."""
        folder = self.zip_path.with_suffix("")
        if all((folder / name).is_file() for name in _FILES):
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        try:
            with zipfile.ZipFile(self.zip_path) as z:
                for name in _FILES:  # only the files we read: no paths taken from the archive
                    with z.open(name) as src, open(tmp / name, "wb") as dst:
                        shutil.copyfileobj(src, dst)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return folder

    def _load(self) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        folder = self._folder()
        self._tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32, use_safetensors=True)
        self._model = model.eval()
        self.dimensions = int(model.config.hidden_size)
        log.info("embedding model %s loaded (%d dimensions)", self.model_id, self.dimensions)

    async def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """Unit-length float32 vectors [len(texts), dimensions] and the number of tokens embedded."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._embed, texts)

    def _embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        import torch

        batch = self._tokenizer(texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt")
        with torch.inference_mode():
            hidden = self._model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            vectors = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return vectors.numpy().astype(np.float32), int(batch["attention_mask"].sum())
