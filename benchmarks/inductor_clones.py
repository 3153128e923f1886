"""Which tensors inductor copies before fp8train's Triton kernels, and why (GPU).

    PYTHONPATH=. python benchmarks/inductor_clones.py --tokens 2048

torch.compile runs a user Triton kernel through `triton_kernel_wrapper_functional`, which copies every
tensor the kernel might write (`tensors_to_clone`, from torch's analysis of the kernel's TTIR) so that the
graph stays functional; inductor removes a copy only when nothing reads the original afterwards. A kernel
input listed there costs a full read and write of it per launch. This prints, for one compiled Qwen2
decoder layer of the 7B shape, each of our kernel nodes with its `tensors_to_clone`, torch's analysis of
each kernel on the launch's real arguments, and the copy kernels in inductor's generated code.
"""

from __future__ import annotations

import argparse
import re

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    args = p.parse_args()
    from torch._higher_order_ops import triton_kernel_wrap as tkw
    from torch._inductor.utils import run_and_get_code
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fp8train import compile_options, convert_to_fp8
    from fp8train.fp8 import kernels
    from fp8train.fp8.compile import ShareQuantization

    seen = []

    class Spy(ShareQuantization):
        def __call__(self, graph):
            for n in graph.nodes:
                if n.op == "call_function" and n.target is tkw.triton_kernel_wrapper_functional:
                    k = tkw.kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
                    while hasattr(k, "fn"):
                        k = k.fn
                    consts = tkw.kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"])
                    reads = {a: ((v.name, str(v.target), [str(x) for x in v.args][:2]) if isinstance(v, torch.fx.Node) else v)
                             for a, v in n.kwargs["kwargs"].items()
                             if not (isinstance(v, torch.fx.Node) and "empty" in str(v.target))}
                    seen.append((k.__name__, list(n.kwargs["tensors_to_clone"]), consts, reads, n.kwargs["grid"]))
            return super().__call__(graph)

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=3584, intermediate_size=18944, num_hidden_layers=1,
                      num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=args.tokens)
    model = Qwen2ForCausalLM(cfg).cuda()
    convert_to_fp8(model, "hybrid")
    layer = model.model.layers[0]
    layer.compile(options={**compile_options(), "joint_custom_pre_pass": Spy()})
    ids = torch.randint(0, 1024, (1, args.tokens), device="cuda")

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    _, codes = run_and_get_code(step)
    print("kernel nodes and their tensors_to_clone (joint graph, before our pass):")
    for name, clones, consts, reads, grid in seen:
        print(f"  {name}: clone {clones}; reads {reads}; grid {grid}; constants {consts}")
    x = torch.randn(args.tokens, 3584, device="cuda", dtype=torch.bfloat16)
    qr = torch.empty(args.tokens, 3584, device="cuda", dtype=torch.float8_e4m3fn)
    sr = torch.empty(7, args.tokens, device="cuda")
    qc = torch.empty(3584, args.tokens, device="cuda", dtype=torch.float8_e4m3fn)
    sc = torch.empty(args.tokens // 128, 3584, device="cuda")
    act = dict(x_ptr=x, M=args.tokens, K=3584, stride_xm=3584, qr_ptr=qr, sr_ptr=sr, Kp=3584, qc_ptr=qc,
               sc_ptr=sc, Mp=args.tokens, ROW_MAX=448.0, COL_MAX=448.0, POW2=True, COLS=True, BF16=True, BLOCK=128)
    for fn_name in ("identify_mutated_tensors", "identify_accessed_tensors"):
        fn = getattr(tkw, fn_name, None)
        if fn is not None:
            try:
                print(f"{fn_name}(_act_kernel):", fn(kernels._act_kernel, act, {}))
            except Exception as e:  # noqa: BLE001 - a diagnostic: print what torch says
                print(f"{fn_name}(_act_kernel) raised {type(e).__name__}: {e}")
    code = "\n".join(codes)
    copies = re.findall(r"(triton_\w*(?:clone|copy)\w*)\.run\(", code)
    print(f"copy/clone kernel launches in the generated code: {len(copies)}; distinct: {sorted(set(copies))[:20]}")
    for line in code.splitlines():
        if re.search(r"_act_kernel\w*\.run\(|_weight_kernel\w*\.run\(", line):
            print("  launch:", line.strip()[:220])
    with open("/tmp/inductor_code.py", "w") as f:
        f.write(code)


if __name__ == "__main__":
    main()
