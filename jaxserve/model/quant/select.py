"""How a quantized matrix is multiplied on each backend: one table, as device_select.py's for
attention and dtypes, resolving `int8_activations` and `dequant_form` ("auto" or explicit) for a
DeviceDescription into a MatmulForm, each answer with its reason for the start-up log.

* int8 activations (per-channel int8 weights only): each activation row is quantized to int8
  in two levels (the value, then its rounding error) and both go through one int8 x int8 ->
  int32 dot (qlinear.int8_dot): on the CPU jaxserve's kernel or XLA's dot (YNNPACK), on a TPU
  the MXU's int8 path. The integer sums are exact, so the arithmetic is the same on every
  backend, and so is its teacher-forced agreement with float32 on the default model (96.9%,
  mean KL 0.0067; the bar: >= 95% and < 0.01, tests/test_quant_default.py). "auto" turns it on
  where an int8 dot reads the weights as stored at a higher rate than a float one: the CPU
  and the TPUs JAX lists with an int8 MXU rate (v5e, v5p, v6e). Elsewhere (GPUs, other TPUs)
  the weights are dequantized next to a float dot. On a CPU (one device) the runner then
  goes further under "auto": at warm-up it times each token bucket's matmuls with int8
  activations through jaxserve's kernel, through XLA's int8 dot, and dequantized, and traces
  each bucket in its fastest form (model/quant/bucket_forms.py: with many rows the two int8
  levels' multiply-adds can cost more than a dequantize-then-dot, on CPUs without an int8
  multiply-add instruction).
* dequant form, for every quantized matrix not multiplied as int8: "chunked" is the CPU's
  (XLA's CPU dot does not fuse the int8 -> float convert, so a matrix is dequantized at most
  qlinear.CHUNK_BYTES of float rows at a time, each piece pinned after the previous result,
  and the head loops over vocabulary chunks); "fused" is one dequantize-then-dot, which XLA
  fuses into the matmul on GPUs and TPUs. "auto": chunked on the CPU, fused elsewhere.

With int8 activations on, `--quantization int8` gives per-channel int8 for every source: a
GGUF's blocks (groups of 32) are dequantized and requantized per channel at load
(model/loaders/loader.py), which keeps the bar above; off, they map exactly to int8 groups of 32.
This module must not import jax or the model: a mocked DeviceDescription gets exactly the
answer the real device gets.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config.settings import DEQUANT_FORMS
from jaxserve.config.settings import INT8_ACTIVATION_MODES as INT8_ACTIVATIONS
from jaxserve.model.device.select import DeviceDescription, log_choice
# TPU device kinds (as JAX reports them) whose MXU multiplies int8 at a rate JAX's Pallas
# tpu_info lists (v5e 394, v5p 459 per core, v6e 1836 int8 TOPS); v2-v4 and TPU7x list none.
INT8_MXU_TPUS = frozenset({"TPU v5 lite", "TPU v5e", "TPU v5", "TPU v5p", "TPU v6 lite",
                           "TPU v6e"})


@dataclass(frozen=True)
class MatmulForm:
    """How the step multiplies quantized matrices (static: part of the compiled program)."""

    int8_activations: bool = False  # per-channel int8 x int8 activations, one integer dot
    chunked: bool = False           # dequantized in pinned row pieces, the head in a loop
    int8_kernel: bool = True        # that dot by jaxserve's CPU kernel where it runs, else XLA's

    def describe(self) -> str:
        dot = "" if self.int8_kernel or not self.int8_activations else " (XLA's int8 dot)"
        return (f"int8 activations {'on' if self.int8_activations else 'off'}{dot}, "
                f"dequantization {'chunked' if self.chunked else 'fused'}")


@dataclass(frozen=True)
class FormSelection:
    form: MatmulForm
    int8_reason: str
    dequant_reason: str


def _int8_auto(device: DeviceDescription) -> tuple[bool, str]:
    if device.platform == "cpu":
        return True, ("the CPU's int8 x int8 -> int32 dot reads the weights as stored "
                      "(float dots widen them first); two-level activations keep the "
                      "teacher-forced agreement bar")
    if device.platform == "tpu" and device.device_kind in INT8_MXU_TPUS:
        return True, (f"{device.device_kind} multiplies int8 on its MXU; the same two-level "
                      "activations and exact int32 sums as the CPU's, whose agreement passes")
    if device.platform == "tpu":
        return False, f"no int8 MXU rate is listed for {device.device_kind!r}"
    return False, "on GPUs the weights are dequantized next to a bfloat16 dot XLA fuses"


def select(int8_activations: str = "auto", dequant_form: str = "auto",
           device: DeviceDescription | None = None) -> FormSelection:
    """Resolve "auto" and check explicit choices for one device (default: the current one)."""
    if int8_activations not in INT8_ACTIVATIONS:
        raise ValueError(f"int8_activations must be one of {', '.join(INT8_ACTIVATIONS)}, "
                         f"got {int8_activations!r}")
    if dequant_form not in DEQUANT_FORMS:
        raise ValueError(f"dequant_form must be one of {', '.join(DEQUANT_FORMS)}, "
                         f"got {dequant_form!r}")
    device = device or DeviceDescription.current()
    if int8_activations == "auto":
        int8, int8_reason = _int8_auto(device)
    else:
        int8, int8_reason = int8_activations == "on", "chosen explicitly"
    if dequant_form == "auto":
        chunked = device.platform == "cpu"
        dequant_reason = ("XLA's CPU dot does not fuse the int8 -> float convert: pieces of at "
                          "most 4 MiB, pinned in order, the head in a loop" if chunked else
                          "one dequantize-then-dot, which XLA fuses into the matmul")
    else:
        chunked, dequant_reason = dequant_form == "chunked", "chosen explicitly"
    return FormSelection(MatmulForm(int8, chunked), int8_reason, dequant_reason)


def resolve(int8_activations: str, dequant_form: str,
            device: DeviceDescription | None = None) -> MatmulForm:
    """select(), each choice logged once per process with its reason."""
    device = device or DeviceDescription.current()
    chosen = select(int8_activations, dequant_form, device)
    log_choice("int8_activations", "on" if chosen.form.int8_activations else "off",
               chosen.int8_reason, device)
    log_choice("dequant_form", "chunked" if chosen.form.chunked else "fused",
               chosen.dequant_reason, device)
    return chosen.form
