"""A checkpoint as a user brings one: a NemotronH saved by transformers beside a real
tokenizer (a byte-level BPE trained here with the `tokenizers` library on text full of
multi-byte characters) and a Jinja chat template, saved by transformers too.

The weights are random (seeded), so generations are arbitrary token sequences of this
vocabulary: most tokens are pieces of multi-byte characters, which is what streaming
text must survive. `transformers` is the reference every fidelity test compares with.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.executor.oracle import tiny_config

# ruff: noqa: RUF001 (the ambiguous characters are the point of this corpus)
CORPUS = [
    "Grüße aus Köln! Ça va? naïve café résumé — “quotes” and plain English words.",
    "日本語のテキスト、中文的句子，한국어 문장. Emoji: 🙂🚀🎉 👩‍💻 and more.",
    "ΑΒΓ δεζ Жж Ѣ ħ ŋ ł ø å ß ü ö ä é è ê ë — en dash – ellipsis … «guillemets»",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { }",
]
SPECIALS = ["<|bos|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 420  # trained up to this size; the model's vocabulary is what training gave

# ChatML with a BOS the template emits itself, an error for a misplaced system message
# (raise_exception), and list content handled by the template (text parts joined).
TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('a system message may only come first') }}"
    "{% endif %}"
    "<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}"
    "{% elif m.content is not none %}"
    "{% for part in m.content %}{{ part.text }}{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# What NemotronH's own template does for agents, written here: tools listed in the
# system turn, assistant tool calls in the Qwen3-Coder XML the MoE releases write, tool
# results as a user turn's <tool_response>, and every assistant turn opening with a
# <think> block that `truncate_history_thinking` (default true) empties before the last
# user message; the generation prompt opens the block unless `enable_thinking` is false.
AGENT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set truncate = truncate_history_thinking if truncate_history_thinking is defined "
    "else true %}"
    "{%- set thinking = enable_thinking if enable_thinking is defined else true %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{%- if tools or messages[0].role == 'system' %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{%- if tools %}\n\n# Tools\n<tools>"
    "{%- for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>{% endif %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if truncate and loop.index0 < ns.last_user %}<think></think>"
    "{%- else %}<think>{{ m.reasoning_content or '' }}</think>{% endif %}"
    "{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}<tool_call>\n<function={{ call.function.name }}>\n"
    "{%- for key, value in call.function.arguments | items %}<parameter={{ key }}>\n"
    "{%- if value is string %}{{ value }}{% else %}{{ value | tojson }}{% endif %}"
    "\n</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if thinking %}<think>\n{% else %}<think></think>{% endif %}{% endif %}"
)

LAYERS = ["linear_attention", "full_attention", "mlp", "linear_attention", "mlp"]
# the agent checkpoint is a MoE hybrid, as NemotronH's agent releases are: served through
# `custody up --model` by the agent tests
AGENT_LAYERS = ["linear_attention", "full_attention", "moe", "linear_attention", "mlp"]
AGENT_MOE = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "moe_shared_expert_intermediate_size": 32,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 1.5,
}


def train_tokenizer():
    """A byte-level BPE whose post-processor adds BOS to raw text (as Llama's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", bos)]
    )
    return tok


def build_chat_checkpoint(
    directory: Path,
    template_in: str = "jinja",
    template: str = TEMPLATE,
    layers: list[str] | None = None,
    **config: object,
) -> Path:
    """Save tokenizer and model into `directory`. `template_in`: "jinja" (transformers'
    default, chat_template.jinja) or "config" (tokenizer_config.json's chat_template);
    `layers` and `config`: the model's, else the dense test model's."""
    from transformers import NemotronHForCausalLM, PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(), bos_token="<|bos|>", eos_token="<|im_end|>"
    )
    fast.chat_template = template
    fast.save_pretrained(directory, save_jinja_files=template_in == "jinja")
    torch.manual_seed(0)
    cfg = tiny_config(
        len(fast),
        layers or LAYERS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        **config,
    )
    model = NemotronHForCausalLM(cfg).float().eval()
    with torch.no_grad():  # transformers initialises the routers' score correction to 0
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def reference(directory: Path):
    """transformers' own tokenizer and model for the checkpoint in `directory`."""
    from transformers import AutoTokenizer, NemotronHForCausalLM

    model = NemotronHForCausalLM.from_pretrained(directory).float().eval()
    return AutoTokenizer.from_pretrained(directory), model
