"""Which op of layer 0 departs from float32 truth on the GPU? Same bf16 input through each implementation."""
import sys, os, torch, transformers
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kiln.models import LlamaForCausalLM
from kiln.models.llama import DecoderForCausalLM
from kiln.kernels import ReferenceOps, TritonOps, AttentionMetadata
rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                               num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_parameters=rope)
torch.manual_seed(0)
dev = "cuda"
with torch.device(dev):
    hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
model = LlamaForCausalLM.from_hugging_face(hf)
T = 300
prompt = torch.randint(10, 128000, (T,), device=dev)
rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
x = hf.model.embed_tokens(prompt)[None]                                  # (1, T, H) bf16
layer = hf.model.layers[0]
pos = torch.arange(T, device=dev)[None]
cos_sin = hf.model.rotary_emb(x, pos)
with torch.no_grad():
    xn = layer.input_layernorm(x)
    attn_bf16 = layer.self_attn(xn, position_embeddings=cos_sin, attention_mask=None)[0]
    mlp_bf16 = layer.mlp(xn)
    q_bf = layer.self_attn.q_proj(xn)
hf32 = transformers.LlamaForCausalLM(cfg).to(dev).eval(); hf32.load_state_dict({k: v.float() for k, v in hf.state_dict().items()})
l32 = hf32.model.layers[0]
with torch.no_grad():
    xn32 = xn.float()
    cs32 = hf32.model.rotary_emb(xn32, pos)
    attn32 = l32.self_attn(xn32, position_embeddings=cs32, attention_mask=None)[0]
    mlp32 = l32.mlp(xn32)
    q32 = l32.self_attn.q_proj(xn32)
print("q_proj: hf-bf16", rel(q_bf, q32))
print("hf-bf16 attention vs fp32 (no mask given)", rel(attn_bf16, attn32), "mlp", rel(mlp_bf16, mlp32))
with torch.no_grad():
    full32 = l32(x.float(), position_embeddings=cs32, attention_mask=None)
    full32 = full32[0] if isinstance(full32, tuple) else full32
    full_bf = layer(x, position_embeddings=cos_sin, attention_mask=None)
    full_bf = full_bf[0] if isinstance(full_bf, tuple) else full_bf
print("hf-bf16 full layer vs fp32", rel(full_bf, full32))
for name, ops in (("triton", TritonOps()), ("reference", ReferenceOps())):
    net = DecoderForCausalLM.load(model.config, model.engine_weights(), 1024, dev, ops=ops)
    t = lambda v: torch.tensor(v, device=dev)
    meta = lambda: AttentionMetadata(t(list(range(T))), t([0, T]), t([T]), t([list(range(10))]), T, T, 32)
    cache = lambda: torch.zeros((2, 16, 32, 8, 128), dtype=torch.bfloat16, device=dev)
    layer0 = net.layers[0]
    with torch.inference_mode():
        a = layer0.attn(xn[0], pos[0], meta(), cache(), net.cos_sin)
        m = layer0.mlp(xn[0])
        qkv = ops.linear(xn[0], layer0.attn.qkv_proj.weight)
        emb = net.embed_tokens(prompt)
        o = layer0(emb.clone(), None, pos[0], meta(), cache(), net.cos_sin)
    print(name, "attention vs fp32", rel(a, attn32[0]), "mlp vs fp32", rel(m, mlp32[0]), "q part", rel(qkv[:, :4096], q32[0]))
    print(name, "embedding", rel(emb, x[0]), "full layer vs fp32", rel(o[0] + o[1], full32[0]),
          "vs hf-bf16", rel(o[0] + o[1], full_bf[0]))
