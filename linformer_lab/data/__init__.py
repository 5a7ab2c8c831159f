"""LightningDataModules. Copy task (paper §4.1.1) and image generation (§4.2); see docs/ARCHITECTURE.md, "Contracts"."""

from linformer_lab.data.copy import CopyDataModule
from linformer_lab.data.errors import DataNotFoundError
from linformer_lab.data.images import CIFAR10DataModule, MNISTDataModule

__all__ = ["CopyDataModule", "MNISTDataModule", "CIFAR10DataModule", "DataNotFoundError"]
