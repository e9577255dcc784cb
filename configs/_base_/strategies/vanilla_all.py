# "Vanilla BP, All": finetune every layer with the exact backward (backbone
# BN statistics fixed by the model bases' norm_eval=True).
_base_ = ['../schedules/finetune_20k_ref.py']
