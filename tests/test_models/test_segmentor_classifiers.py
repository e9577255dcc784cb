"""Which layers are a decode head's classifier, by path
(:mod:`mmseg_gf.models.segmentor`): ``conv_seg`` / ``fc_seg``, Segmenter's
class-score Linears directly under the head, and SAN's
``rec_with_attnbias.proj`` (its mask tokens' projection, whose product with
the text encoder's class embeddings gives the class scores)."""
import pytest

from mmseg_gf.models.segmentor import is_class_score_layer, is_classifier


@pytest.mark.parametrize('path', [
    'decode_head.conv_seg', 'decode_head.1.conv_seg',
    'decode_head.1.fc_seg', 'decode_head.patch_proj',
    'decode_head.classes_proj', 'decode_head.rec_with_attnbias.proj',
    'decode_head.0.rec_with_attnbias.proj'
])
def test_classifier_paths(path):
    assert is_classifier(path)


@pytest.mark.parametrize('path', [
    'auxiliary_head.rec_with_attnbias.proj',
    'backbone.rec_with_attnbias.proj', 'decode_head.proj',
    'decode_head.rec_with_attnbias.layers.2.attentions.0.attn.out_proj',
    'decode_head.side_adapter_network.rec_with_attnbias.proj',
    'decode_head.layers.0.patch_proj', 'rec_with_attnbias.proj'
])
def test_not_classifier_paths(path):
    assert not is_classifier(path)
    assert not is_class_score_layer(path)
