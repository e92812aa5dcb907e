"""Where does the 8B-shaped engine depart from transformers? Compare Triton vs reference kernels layer by layer."""
import sys, os, torch, transformers
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kiln.benchmark import SHAPES
from kiln.models import LlamaForCausalLM
from kiln.models.llama import DecoderForCausalLM
from kiln.kernels import ReferenceOps, TritonOps, AttentionMetadata

shape = SHAPES["llama-3.1-8b"]
rope = {"rope_type": "llama3", "rope_theta": shape["rotary_base"], **{k: v for k, v in shape["rope_scaling"].items() if k != "type"}}
layers = int(sys.argv[1]) if len(sys.argv) > 1 else 32
cfg = transformers.LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                               num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_parameters=rope)
torch.manual_seed(0)
with torch.device("cuda"):
    hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
model = LlamaForCausalLM.from_hugging_face(hf)
w = model.engine_weights() if hasattr(model, "engine_weights") else None
prompt = torch.randint(10, 128000, (300,)).tolist()
T = len(prompt)
rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
outs = {}
for name, ops in (("triton", TritonOps()), ("reference", ReferenceOps())):
    net = DecoderForCausalLM.load(model.config, w, 1024, "cuda", ops=ops)
    caches = [torch.zeros((2, 16, 32, 8, 128), dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    t = lambda x: torch.tensor(x, device="cuda")
    meta = AttentionMetadata(t(list(range(T))), t([0, T]), t([T]), t([list(range(10))]), T, T, 32)
    hidden = []
    hooks = [layer.register_forward_hook(lambda m, i, o: hidden.append((o[0] + o[1]).detach().clone())) for layer in net.layers]
    with torch.inference_mode():
        h = net(t(prompt), t(list(range(T))), meta, caches)
        outs[name] = (net.compute_logits(h), hidden)
    for hk in hooks: hk.remove()
with torch.no_grad():
    hs = hf(torch.tensor([prompt], device="cuda"), output_hidden_states=True)
    hf.float()
    truth = hf(torch.tensor([prompt], device="cuda"), output_hidden_states=True)
ref_logits = hs.logits[0].float()
print("logits vs fp32 truth: triton", rel(outs["triton"][0], truth.logits[0]), "reference", rel(outs["reference"][0], truth.logits[0]),
      "hf-bf16", rel(ref_logits, truth.logits[0]))
print("logits triton vs hf", rel(outs["triton"][0], ref_logits), "reference vs hf", rel(outs["reference"][0], ref_logits),
      "triton vs reference", rel(outs["triton"][0], outs["reference"][0]))
for i in range(layers):
    a, b, c, d = outs["triton"][1][i], outs["reference"][1][i], hs.hidden_states[i + 1][0], truth.hidden_states[i + 1][0]
    if (i < 4 or i % 4 == 3) and i < layers - 1:
        print(f"layer {i}: vs fp32 truth: triton {rel(a, d):.4f} reference {rel(b, d):.4f} hf-bf16 {rel(c, d):.4f}", flush=True)
