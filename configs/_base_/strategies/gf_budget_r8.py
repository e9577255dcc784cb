# Budget: as many last convs as fit at r = 8 within a backward-FLOPs
# budget. The pipeline sets backward_gflops per model to the predicted
# backward GFLOPs per image of "GF last 5 (or 10), r = 4" (the strategy's
# budget_like in mmseg_gf/protocol/experiments.py); used on its own, give it
# a value, e.g. --cfg-options gradient_filter.budget.backward_gflops=0.5.
_base_ = ['../schedules/finetune_20k_ref.py']
gradient_filter = dict(budget=dict(backward_gflops=None, radii=[8]),
                       layer_kinds=['conv2d'])
