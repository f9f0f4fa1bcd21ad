"""The part of vLLM-Ascend pdcluster calls, emulated on CPU next to the torch_npu emulator: its op library
`vllm_ascend.vllm_ascend_C`, which registers the LoRA custom ops `torch.ops._C_ascend.{bgmv,sgmv}_{shrink,expand}`
(vllm_ascend_C.py). Nothing else of vLLM-Ascend is here."""

EMULATED = True
