# Loss and test accuracy per epoch of examples/train.lua (gnuplot, Debian's gnuplot-nox).
#
#   gnuplot -e "data='checkpoints/metrics.tsv'; out='checkpoints/metrics.png'" examples/plot.gp
#
# data: two blocks separated by two blank lines (gnuplot's "index"): 0 = pretraining, 1 = linear
# evaluation; columns: epoch, mean training loss, test accuracy. train.lua writes it from the JSONL.
if (!exists("data")) data = 'checkpoints/metrics.tsv'
if (!exists("out")) out = 'checkpoints/metrics.png'

set terminal pngcairo size 1100,450 enhanced font "DejaVu Sans,11" noenhanced
set output out
set datafile missing "NaN"
set multiplot layout 1,2 title "Fashion-MNIST with FSDP: pretraining and linear evaluation of the frozen trunk"

set style line 1 lc rgb "#1f77b4" lw 2 pt 7 ps 1.2
set style line 2 lc rgb "#d62728" lw 2 pt 5 ps 1.2
set grid lc rgb "#dddddd"
set key top right
set xlabel "epoch"
set xtics 1
set mxtics 1

set title "training loss (mean over the epoch)"
set ylabel "cross entropy"
set yrange [0:*]
plot data index 0 using 1:2 with linespoints ls 1 title "pretrain", \
     data index 1 using 1:2 with linespoints ls 2 title "linear eval (new head)"

set title "test accuracy (10k images)"
set ylabel "accuracy"
set yrange [*:*]
set format y "%.3f"
set key bottom right
plot data index 0 using 1:3 with linespoints ls 1 title "pretrain", \
     data index 1 using 1:3 with linespoints ls 2 title "linear eval (new head)", \
     0.89 with lines dt 2 lc rgb "#1f77b4" title "pretrain target 0.89", \
     0.85 with lines dt 2 lc rgb "#d62728" title "linear-eval target 0.85"

unset multiplot
