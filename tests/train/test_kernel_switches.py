"""The trainer hands its kernel switch (TrainConfig.compile_hc) to its model, as the engine does
(models/layers/kernel_switch.py; the engine's side: tests/engine/test_decode_path.py)."""

from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config
from lockstep.models.layers.kernel_switch import KernelSwitches, Switched
from lockstep.train.config import TrainConfig
from lockstep.train.trainer import Trainer


def test_the_trainer_hands_compile_hc_to_its_model():
    model = DeepseekV4ForCausalLM(tiny_config())
    init_deepseek_v4_(model, 1)
    trainer = Trainer(model, TrainConfig(compile_hc=False))
    switched = [m for m in trainer.model.modules() if isinstance(m, Switched)]
    assert switched and all(m.kernels == KernelSwitches(compile_hc=False) for m in switched)
