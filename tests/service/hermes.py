"""A random-weight Qwen2 with stories260K's tokenizer and a Hermes-style chat template (tools in the system
prompt, calls as <tool_call>{...}</tool_call>): a chat model whose only sense is what a grammar forces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.structured.schema_battery import SCHEMAS

HERMES_TEMPLATE = """
{%- if messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}
{%- endif %}
{%- if tools %}
# Tools
Call a function by writing <tool_call>{"name": <function name>, "arguments": <arguments>}</tool_call>.
<tools>
{%- for tool in tools %}
{{ tool.function | tojson }}
{%- endfor %}
</tools>
{%- endif %}<|im_end|>
{%- for message in messages %}
{%- if message.role != 'system' %}
<|im_start|>{{ message.role }}
{%- if message.role == 'tool' %}
<tool_response>{{ message.content }}</tool_response>
{%- else %}
{{ message.content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}</tool_call>
{%- endfor %}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}
{%- endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": SCHEMAS["tool_arguments_like"]}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 10}, "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["query"], "additionalProperties": False}}}
TOOL_SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "search": SEARCH["function"]["parameters"]}


def make_hermes_checkpoint(qwen2_dir: Path, path: Path) -> Path:
    """Copy the random Qwen2 checkpoint to `path` with the Hermes template and a longer context."""
    shutil.copytree(qwen2_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    model_config = json.loads((path / "config.json").read_text())  # rotary positions: longer is the same model
    (path / "config.json").write_text(json.dumps({**model_config, "max_position_embeddings": 2048}))
    return path
