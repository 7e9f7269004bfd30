"""Chat templates written for the parity tests, each in the manner of a popular family.

They use what real templates use: the system prompt taken out of the
messages, ``loop.first``/``loop.last``/``loop.index0``, ``namespace``,
tools and ``tojson`` with its options, ``raise_exception`` on a bad role or
order, ``strftime_now``, ``{%- -%}`` and the environment's block trimming
(indented, multi-line sources), ``{% break %}``/``{% continue %}``,
``documents``, ``dict``, reasoning fields, ``{% generation %}``, and the
special tokens as variables.
"""

from __future__ import annotations

# A header per message, the system prompt pulled out and dated, tools as
# indented JSON inside the first user message (the Llama 3 way).
HEADERS = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|im_start|>system\\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y") + "\\n\\n" }}
{{- system_message }}
{{- "<|im_end|>" }}
{%- for message in messages %}
    {%- if loop.first and tools is not none %}
        {{- '<|im_start|>user\\nFunctions:\\n' }}
        {%- for t in tools %}
            {{- t | tojson(indent=4) }}
            {{- "\\n\\n" }}
        {%- endfor %}
        {{- message['content'] | trim + '<|im_end|>' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Strict user/assistant alternation enforced with raise_exception, the
# system prompt folded into the first user turn (the Mistral way).
ALTERNATING = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user, assistant and a first system role are supported!') }}
    {%- endif %}
{%- endfor %}
"""

# No system role at all, "assistant" renamed "model", and blocks left to
# trim_blocks/lstrip_blocks rather than dashes (the Gemma way).
TURNS = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {{ raise_exception('System role not supported') }}
{% endif %}
{% for message in messages %}
    {% if (message['role'] == 'assistant') %}
        {% set role = 'model' %}
    {% else %}
        {% set role = message['role'] %}
    {% endif %}
    {{ '<|im_start|>' + role + '\n' + message['content'] | trim + '<|im_end|>\n' }}
{% endfor %}
{% if add_generation_prompt %}
    {{'<|im_start|>model\n'}}
{% endif %}
"""

# Tools in a system block, tool calls and tool results, the last user turn
# found with a namespace, reasoning shown only after it, loop controls and
# the generation tag (the Qwen way).
TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1, calls=0) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- continue %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {%- if message.reasoning_content is defined and loop.index0 > ns.last_user %}
            {{- '<think>\\n' + message.reasoning_content | trim + '\\n</think>\\n\\n' }}
        {%- endif %}
        {%- if message.content is defined %}
            {{- message.content }}
        {%- endif %}
        {%- for call in message.tool_calls | default([]) %}
            {%- set ns.calls = ns.calls + 1 %}
            {%- if call.function is defined %}
                {%- set call = call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments | tojson(ensure_ascii=True) + '}\\n</tool_call>' }}
        {%- endfor %}
        {%- endgeneration %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}
        {{- '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
    {%- if message.content is defined and message.content == 'STOP' %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Grounding documents, a dict built in the template and JSON with sorted
# keys and compact separators, the last turn marked with loop.last (the
# Command-R / Phi way).
DOCUMENTS = """{%- set meta = dict(model='tiny', turns=messages | length) %}
{{- '<|im_start|>system\\n' + meta | tojson(sort_keys=True, separators=(',', ':')) }}
{%- if documents %}
    {{- '\\n## Documents' }}
    {%- for doc in documents %}
        {{- '\\nDocument ' + loop.index | string + ': ' + doc.title + '\\n' + doc.text }}
    {%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}
    {%- if loop.last and message['role'] == 'user' %}
        {{- ' (' + dict.fromkeys(['answer', 'briefly']) | list | join(' ') + ')' }}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
"""

# A template that breaks the sandbox rules: underscore names on a namespace.
UNDERSCORE = """{%- set ns = namespace(_secret=1) %}{{ messages[0]['content'] }}"""

# Named templates: one for requests with tools, one default.
NAMED_DEFAULT = """{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"""
NAMED_TOOL_USE = """{% for t in tools %}[{{ t.function.name }}]{% endfor %}""" + NAMED_DEFAULT
