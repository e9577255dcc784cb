# A control, not in the paper's tables: finetune only the classifier
# (decode_head.conv_seg) with the finetuning schedule, every other weight and
# every BN statistic frozen (linear probing of the calibrated features).
# It separates what training the last N convs adds from what a longer
# classifier training alone gives.
_base_ = ['../schedules/finetune_20k_ref.py']
custom_hooks = [
    dict(
        type='CalibrationHook',
        trainable=['decode_head.conv_seg'],
        update_norm_stats=False)
]
