from runtime import Engine, SamplingParams
from smollm2 import gguf_file
from bench_speculative import OPEN, chat, NGRAM
path = gguf_file()
import os; Q = os.environ.get("Q", "auto"); D = os.environ.get("D", "float32")
off = Engine.from_pretrained(path, dtype=D, num_blocks=400, quantization=Q)
on = Engine.from_pretrained(path, dtype=D, num_blocks=400, speculative_config=NGRAM, quantization=Q)
p = SamplingParams(max_tokens=96, temperature=0, logprobs=2)
for q in OPEN:
    pr = chat(off, q)
    a = off.generate([pr], p)[0].outputs[0]; b = on.generate([pr], p)[0].outputs[0]
    if a.token_ids != b.token_ids:
        i = next(i for i,(x,y) in enumerate(zip(a.token_ids,b.token_ids)) if x!=y)
        print("DIVERGE", q, i, a.logprobs[i], b.logprobs[i])
    else:
        print("SAME", q)
