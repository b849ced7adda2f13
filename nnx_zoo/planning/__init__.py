"""Compiling for TPU and GPU targets without the hardware: abstract devices by topology name."""

from nnx_zoo.planning.targets import TargetError, target_devices, target_platform

__all__ = ["TargetError", "target_devices", "target_platform"]
