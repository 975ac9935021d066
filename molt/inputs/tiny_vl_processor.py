"""The tiny VLM's processor: Qwen2.5-VL's, without its video processor.

Every video processor in transformers needs torchvision, which has no CPU build for the torch that
vLLM's CPU build pins; images need only Pillow. `molt.inputs.tiny` copies this file into the model folder and
names it in `auto_map`, so the folder loads with `trust_remote_code` wherever transformers or vLLM
look for its processor. It must import nothing but transformers.
"""

from transformers import ProcessorMixin
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor


class TinyVLProcessor(Qwen2_5_VLProcessor):
    # The processor's parts are read from this signature: image processor and tokenizer only.
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
