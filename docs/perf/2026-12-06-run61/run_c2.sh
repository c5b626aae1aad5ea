#!/usr/bin/env bash
# Run 61 call 2: the W13 forward's expert-group order forced on in training, at the layer.
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"
NEW=new=w13:training:expert_groups=True
ab deepseek-v3 fwdbwd sampled 9 $NEW
ab gpt-oss-120b fwdbwd sampled 9 $NEW
ab fine fwdbwd sampled 9 $NEW
ab olmoe fwdbwd sampled 9 $NEW
ab issue-b fwdbwd sampled 9 $NEW
ab issue-a fwdbwd sampled 7 $NEW
(cd $OUT && tar czf logs.tgz --remove-files -- *.log 2>/dev/null); ls $OUT
