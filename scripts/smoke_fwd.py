import torch, flash_attn_hopper as fah
from flash_attn_hopper.testing import attention_ref
torch.manual_seed(0)
for hd in (64,128,256):
  for dt in (torch.bfloat16, torch.float16):
    for causal in (False, True):
      for sq, sk in ((1,1),(113,203),(203,113),(1024,1024)):
        q=torch.randn(2,sq,3,hd,device='cuda',dtype=dt); k=torch.randn(2,sk,3,hd,device='cuda',dtype=dt); v=torch.randn(2,sk,3,hd,device='cuda',dtype=dt)
        o,l=fah.attention(q,k,v,causal=causal,return_lse=True); torch.cuda.synchronize()
        ro,rl=attention_ref(q,k,v,causal=causal)
        e=(o.float()-ro).abs().max().item(); el=(l-rl).abs()[torch.isfinite(rl)].max().item() if torch.isfinite(rl).any() else 0
        print(hd,dt,causal,sq,sk,'err_o %.2e err_lse %.2e nan %d'%(e,el,int(torch.isnan(o).any())),flush=True)
