NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
PYTHONPATH=$PWD $NCU --clock-control none --section SourceCounters --section WarpStateStats -k regex:_mma_kernel --launch-skip 8 --launch-count 1 -o $OUT/gate64 python3 -m benchmarks.ncu_mma --n 18944 --k 3584 --m 64 > $OUT/log.txt 2>&1
$NCU --import $OUT/gate64.ncu-rep --page source --print-source sass --csv > $OUT/gate64_src.csv 2>>$OUT/log.txt
PYTHONPATH=$PWD $NCU --clock-control none --section SourceCounters --section WarpStateStats -k regex:_mma_kernel --launch-skip 8 --launch-count 1 -o $OUT/gate16 python3 -m benchmarks.ncu_mma --n 18944 --k 3584 --m 16 >> $OUT/log.txt 2>&1
$NCU --import $OUT/gate16.ncu-rep --page source --print-source sass --csv > $OUT/gate16_src.csv 2>>$OUT/log.txt
ls -la $OUT; tail -3 $OUT/log.txt; head -3 $OUT/gate64_src.csv
