"""nnU-Net's predictor with 8-way mirroring and two weight sets against fastvision's Ensemble (``--tta``, two states)
on one case of the generated CT set: label maps on the file's grid, the share of voxels that differ.

    PYTHONPATH=$PWD /work/nnunet-venv/bin/python benchmarks/runs/2026-12-02-predict-parity/ensemble_tta.py \
        spleen_13 nnunet|monai

The weight sets: nnU-Net's 64-iteration network of the last CT round (copied to /tmp/s57/nn64f) and the current
8-iteration one; fastvision's prediction is flipped into the files' order around it (nnU-Net's networks trained
there), as ``nnunet_parity.py --score --style nnunet`` does."""
import json
import sys

import nibabel as nib
import numpy as np
import torch

sys.path.insert(0, "/work/main/benchmarks")
from nnunet_parity import nnunet_window, to_fastvision  # noqa: E402
from nnunetv2.inference.export_prediction import (  # noqa: E402
    convert_predicted_logits_to_segmentation_with_correct_shape as export,
)
from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor  # noqa: E402
from nnunetv2.utilities.get_network_from_plans import get_network_from_plans  # noqa: E402
from nnunetv2.utilities.plans_handling.plans_handler import PlansManager  # noqa: E402

from fastvision import config  # noqa: E402
from fastvision.data.preprocess3d import mirrored_axes, preprocess_case  # noqa: E402
from fastvision.engine import checkpoint  # noqa: E402
from fastvision.inference.nifti import labels_on_input, prediction_preprocessing  # noqa: E402
from fastvision.inference.volumes import Ensemble  # noqa: E402
from fastvision.models import create_model  # noqa: E402
from fastvision.tasks.segment import SegmentationTask  # noqa: E402

R = "/tmp/s53/w/spleen"
case, style = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "nnunet"
folder = R + "/res/Dataset981_Spleen/Cut__nnUNetPlans__3d_fullres"
pj = json.load(open(folder + "/plans.json"))
plans = PlansManager(pj)
cm = plans.get_configuration("3d_fullres")
dsj = json.load(open(folder + "/dataset.json"))
net = get_network_from_plans(cm.network_arch_class_name, cm.network_arch_init_kwargs,
                             cm.network_arch_init_kwargs_req_import, 1, 2, allow_init=True, deep_supervision=False)
allowed = [np._core.multiarray.scalar, np.dtype, *{type(np.dtype(t)) for t in ("float64", "float32", "int64")}]
sds = []
for f in ("/tmp/s57/nn64f/checkpoint_final.pth", folder + "/fold_0/checkpoint_final.pth"):
    with torch.serialization.safe_globals(allowed):
        sds.append(torch.load(f, map_location="cpu", weights_only=True)["network_weights"])
net.load_state_dict(sds[0])
pr = nnUNetPredictor(tile_step_size=0.5, use_gaussian=True, use_mirroring=True, perform_everything_on_device=False,
                     device=torch.device("cpu"), allow_tqdm=False)
pr.manual_initialization(net, plans, cm, sds, dsj, "Cut", (0, 1, 2))
img = f"{R}/Task09_Spleen/imagesTr/{case}.nii.gz"
data, _, props = cm.preprocessor_class(verbose=False).run_case([img], None, plans, cm, dsj)
logits_nn = pr.predict_logits_from_preprocessed_data(torch.from_numpy(data).float()).float()
seg_nn = export(logits_nn.clone(), plans, cm, plans.get_label_manager(dsj), props).transpose(2, 1, 0)

ck = checkpoint.load(f"{R}/run-nnunet-pfp32-r0/checkpoints/step-00000008.pt")  # the plan's model and data args
cfg = config.from_dict(ck["config"])
cfg.data.args["resample"] = "nnunet"
cfg.data.args["window"] = list(nnunet_window(pj, "ct"))
model = create_model(cfg.model.name, **cfg.model.args)
states = [to_fastvision(sd, model) for sd in sds]
model.load_state_dict(states[0])
model.eval()
params, _ = prediction_preprocessing(None, cfg.data.name, cfg.data.args)
fv = preprocess_case({"image": [img], "label": None}, params)
win = dict(cfg.task.args["sliding_window"], style=style)
task = SegmentationTask(num_classes=2, sample_shape=cfg.task.args["sample_shape"], sliding_window=win,
                        loss=torch.nn.Identity())
ens = Ensemble(task, model, states, torch.device("cpu"), tta_axes=(0, 1, 2))
d = [1 + a for a in mirrored_axes(nib.load(img).affine)]
with torch.no_grad():
    probs = ens.probabilities(torch.flip(fv["image"], d)).flip(d)
lab = labels_on_input(probs, fv["meta"], ens.labels, True, logits=style == "nnunet")
print(case, style, f"voxels differing {(lab != seg_nn).mean():.5f}", "fg", int((lab > 0).sum()),
      int((seg_nn > 0).sum()))
